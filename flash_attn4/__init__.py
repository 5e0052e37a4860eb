"""flash_attn4: fast exact attention for PyTorch.

CUTLASS/CuTe kernels for Hopper GPUs (`flash_attn4._C`), and a plain PyTorch reference for everything
else. Usage: `out = flash_attn4.attn(q, k, v, causal=True)` with q, k, v shaped (batch, seqlen, nheads,
headdim).

Installed without kernels on a machine with a CUDA device, the import warns once (a
`ReferenceFallbackWarning`, saying why and how to build them); on a CPU-only machine it stays silent, since
the reference is the expected path there. To silence it, filter before the import:
`warnings.filterwarnings("ignore", message="flash_attn4: ")`.
"""

import warnings as _warnings

import torch as _torch

from flash_attn4 import _build_info, _ops, dropout, reference
from flash_attn4._build_info import is_built
from flash_attn4._ops import ReferenceFallbackWarning
from flash_attn4.block_mask import BlockMask
from flash_attn4.checks import enable_checks
from flash_attn4.fp8 import hadamard_rotate, quantize_fp8
from flash_attn4.interface import attn, attn_varlen
from flash_attn4.kvcache import attn_with_kvcache, merge_attn_states
from flash_attn4.sparsity import estimate_block_mask

__version__ = "0.1.0"


def _warn_if_kernels_missing() -> None:
    """One warning at import when a CUDA device is visible but the kernels are not there (never built, or
    `flash_attn4._C` fails to import), so a GPU user learns it before the first slow call."""
    if not _torch.cuda.is_available():
        return
    ext, why = _build_info.load_extension()
    if ext is not None:
        return
    _warnings.warn(
        f"flash_attn4: a CUDA device is visible but the CUDA kernels are not available, so every call runs "
        f"on the slow PyTorch reference: {why}",
        ReferenceFallbackWarning,
        stacklevel=2,
    )
    _ops._warned.add(why)  # the first CUDA call would warn again for the same reason: said once is enough


_warn_if_kernels_missing()


def patch_transformers(model=None):
    """Route HuggingFace transformers attention to flash_attn4 (see flash_attn4.integrations.hf)."""
    from flash_attn4.integrations import hf

    return hf.patch_transformers(model)


def unpatch_transformers() -> None:
    """Undo `patch_transformers()` without a model."""
    from flash_attn4.integrations import hf

    hf.unpatch_transformers()


__all__ = [
    "BlockMask",
    "ReferenceFallbackWarning",
    "__version__",
    "attn",
    "attn_varlen",
    "attn_with_kvcache",
    "dropout",
    "enable_checks",
    "estimate_block_mask",
    "hadamard_rotate",
    "is_built",
    "merge_attn_states",
    "patch_transformers",
    "quantize_fp8",
    "reference",
    "unpatch_transformers",
]
