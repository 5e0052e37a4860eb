"""flash_attn4: fast exact attention for PyTorch.

CUTLASS/CuTe kernels for Hopper GPUs (`flash_attn4._C`), and a plain PyTorch reference for everything
else. Usage: `out = flash_attn4.attn(q, k, v, causal=True)` with q, k, v shaped (batch, seqlen, nheads,
headdim).
"""

from flash_attn4 import reference
from flash_attn4._build_info import is_built
from flash_attn4.interface import attn, attn_varlen

__version__ = "0.1.0"


def patch_transformers(model=None):
    """Route HuggingFace transformers attention to flash_attn4 (see flash_attn4.integrations.hf)."""
    from flash_attn4.integrations import hf

    return hf.patch_transformers(model)


def unpatch_transformers() -> None:
    """Undo `patch_transformers()` without a model."""
    from flash_attn4.integrations import hf

    hf.unpatch_transformers()


__all__ = [
    "__version__",
    "attn",
    "attn_varlen",
    "is_built",
    "patch_transformers",
    "reference",
    "unpatch_transformers",
]
