"""Public API: `attn(q, k, v, ...)` and `attn_varlen`, FlashAttention conventions (README, "Semantics")."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import torch
from torch import Tensor

from flash_attn4 import _ops, _ops_sinks, checks, fp8  # (importing _ops registers torch.ops.flash_attn4.*)
from flash_attn4._option_checks import _validate_alibi, _validate_block_mask, _validate_dropout
from flash_attn4._sinks import _validate_sinks, _with_sinks
from flash_attn4.dropout import draw_rng_state

_CUDA_DTYPES = (torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_CUDA_HDIM = 256


def _validate_tensors(q: Any, k: Any, v: Any) -> None:
    """Type, rank, dtype, device and shape agreement of q (b, sq, hq, d) and k, v (b, sk, hk, d)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seqlen, nheads, headdim), got shape {tuple(t.shape)}; "
                "for (batch, nheads, seqlen, headdim) tensors pass x.transpose(1, 2)"
            )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}; move them with .to()"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them with .to()"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree but in the last dim, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, _, hq, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"q and k must have the same batch size, got {b} and {k.shape[0]}")
    if k.shape[3] != d:
        raise ValueError(f"q and k must have the same headdim, got {d} and {k.shape[3]}")
    hk = k.shape[2]
    if hk < 1 or hq % hk != 0:
        raise ValueError(
            f"nheads of q ({hq}) must be a multiple of nheads of k and v ({hk}) (GQA/MQA); "
            "fix the nheads dim (dim 2) of q or of k and v"
        )
    _validate_device_rules(q.device.type, q.dtype, d)
    if v.shape[3] != d:  # MLA-style (qk 192, v 128): sm90 forward kernels, the reference elsewhere
        _validate_device_rules(q.device.type, q.dtype, v.shape[3])


def _validate_device_rules(device_type: str, dtype: torch.dtype, headdim: int) -> None:
    """What each device supports: CUDA kernels take fp16/bf16 and headdim % 8 == 0, <= 256 (16-byte TMA
    rows, largest instantiation); the CPU reference also takes fp32/fp64 and any headdim >= 1."""
    if device_type == "cuda":
        if dtype not in _CUDA_DTYPES:
            raise TypeError(
                f"on CUDA q, k, v must be float16 or bfloat16, got {dtype}; cast with .to(torch.bfloat16)"
            )
        if headdim % 8 != 0 or not 0 < headdim <= _MAX_CUDA_HDIM:
            raise ValueError(
                f"on CUDA headdim must be a multiple of 8 in [8, {_MAX_CUDA_HDIM}], got {headdim}; zero-pad "
                "q, k, v on the last dim to a multiple of 8 and pass softmax_scale=1/sqrt(original headdim)"
            )
    elif device_type in ("cpu", "meta"):
        if dtype not in _CPU_DTYPES:
            raise TypeError(f"on CPU q, k, v must be float16, bfloat16, float32 or float64, got {dtype}")
        if headdim < 1:
            raise ValueError("headdim must be >= 1")
    else:
        raise ValueError(f"flash_attn4 runs on CUDA and CPU tensors, got device type {device_type!r}")


def _validate_flags(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _validate_window(window_size: Any, causal: bool) -> tuple[int, int]:
    """(left, right) ints >= -1; causal=True forbids a right window other than -1 or 0."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(
            f"window_size must be a (left, right) pair, got {window_size!r}; (-1, -1) disables it"
        )
    left, right = window_size
    for side, w in (("left", left), ("right", right)):
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"window_size {side} must be an int, got {type(w).__name__}")
        if w < -1:
            raise ValueError(f"window_size {side} must be >= 0, or -1 for unbounded, got {w}")
    if causal and right not in (-1, 0):
        raise ValueError(
            f"causal=True already means window_size right = 0, which conflicts with right = {right}; "
            "drop causal=True or use window_size=(left, 0)"
        )
    return left, (0 if causal else right)


def _validate_scalar(name: str, value: Any, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite, got {value}")
    return value


def _validate_options(
    headdim: int,
    causal: Any,
    softmax_scale: Any,
    window_size: Any,
    softcap: Any,
    return_lse: Any,
    deterministic: Any,
) -> tuple[float, int, int, float]:
    """The keyword options shared by attn and attn_varlen -> (softmax_scale, left, right, softcap)."""
    _validate_flags(causal=causal, return_lse=return_lse, deterministic=deterministic)
    left, right = _validate_window(window_size, causal)
    softcap = _validate_scalar("softcap", softcap, allow_zero=True)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(headdim)
    softmax_scale = _validate_scalar("softmax_scale", softmax_scale, allow_zero=False)
    return softmax_scale, left, right, softcap


def _warn_reference(q: Tensor, **options: Any) -> None:
    if q.is_cuda:
        names = " and ".join(n for n, x in options.items() if x is not None and x is not False)
        _ops._warn_once(
            f"flash_attn4: no CUDA kernel takes {names} yet; the PyTorch reference runs (correct, but at "
            "most dense speed, and with gradients it keeps seqlen_q x seqlen_k probabilities per head)"
        )


def _block_sparse_kernel(q, k, v, block_mask, causal, left, right) -> bool:
    """Whether attn(block_mask=...) runs the block-sparse kernels (forward and backward). A CUDA call they
    cannot take warns once why."""
    if not q.is_cuda:
        return False
    from flash_attn4 import _ops_sparse

    plan, why = _ops_sparse.kernel_plan(q, k, v, block_mask.block_size, causal, left, right)
    if plan is None and why:
        _ops._warn_once(why)
    return plan is not None


def _general(q, k, v, block_mask, alibi_slopes, dropout_p, softmax_scale, causal, left, right, softcap):
    """What no kernel runs yet (dropout with a block mask or ALiBi, ALiBi with softcap or a block mask, block
    masks the block-sparse kernels cannot take): the PyTorch reference, with a warning on CUDA. Dropout draws
    its (seed, offset) from torch's generator (flash_attn4.dropout)."""
    from flash_attn4._reference_general import general_attention_ref
    from flash_attn4.dropout import draw_seed

    _warn_reference(q, block_mask=block_mask, alibi_slopes=alibi_slopes, dropout_p=dropout_p > 0 or None)
    return general_attention_ref(
        q, k, v, block_mask=block_mask, alibi_slopes=alibi_slopes, causal=causal, softmax_scale=softmax_scale,
        window_size=(left, right), softcap=softcap, dropout_p=dropout_p,
        dropout_seed=draw_seed(q.device) if dropout_p > 0 else (0, 0),
    )  # fmt: skip


def attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    deterministic: bool = False,
    num_splits: int = 0,
    sinks: Tensor | None = None,
    block_mask: Any = None,
    alibi_slopes: Tensor | None = None,
    dropout_p: float = 0.0,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention, O = softmax(scale * Q K^T + mask) V.

    Args:
        q: (batch, seqlen_q, nheads_q, headdim).
        k, v: (batch, seqlen_k, nheads_kv, headdim), nheads_q % nheads_kv == 0 (GQA/MQA: query head h
            reads kv head h // (nheads_q // nheads_kv)). Any strides; fp16/bf16 on CUDA (headdim a multiple
            of 8, <= 256), also fp32/fp64 on CPU.
        causal: query i sees keys j <= i + seqlen_k - seqlen_q (aligned to the bottom-right corner).
        softmax_scale: defaults to 1 / sqrt(headdim).
        window_size: (left, right), -1 = unbounded: query i sees keys in
            [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]. causal=True is right = 0.
        softcap: c > 0 replaces each scaled score s by c * tanh(s / c).
        return_lse: also return the log-sum-exp.
        deterministic: make the backward bitwise reproducible (the CUDA kernel then adds the key blocks'
            contributions to dq in a fixed order, which costs some speed, most with causal). The forward
            and the reference backward are always deterministic.
        num_splits: split-KV for short query blocks (decoding): 0 = choose (the CUDA path then runs the
            split-KV decode kernel when seqlen_q x (nheads_q / nheads_kv) <= 64), 1 = no split, N = force N
            slices of the keys (merged through their LSEs). The result does not depend on it beyond rounding.
        sinks: optional (nheads_q,) learnable logits (GPT-OSS's attention sinks): each row's softmax
            denominator gets exp(sinks[h]) more, with no value behind it; gradients flow to sinks. lse then
            includes the sink (a row that sees no key gets out = 0, lse = sinks[h]).
        block_mask: optional `flash_attn4.BlockMask`: only its blocks are computed, its partial blocks with
            the causal / window mask, its full blocks without (see flash_attn4.block_mask). The sm90
            kernels skip the other blocks, forward and backward (head dims 64 / 96 / 128 / 256; with
            deterministic=True the gradients come from the PyTorch reference).
        alibi_slopes: optional (nheads_q,) or (batch, nheads_q) ALiBi slopes: the logit of query i and key j
            gets -slope * |i + seqlen_k - seqlen_q - j| (after softcap).
        dropout_p: attention dropout for training (pass 0.0 at inference): each probability is dropped
            with probability dropout_p rounded to a multiple of 1 / 256, as FlashAttention-2 rounds it
            (flash_attn4.dropout: a Philox keep mask from (seed, offset) drawn from torch's generator, so
            torch.manual_seed reproduces it), and the kept ones scaled by 1 / (1 - that rounded rate); lse is
            that of the probabilities before dropout.
        q_descale, k_descale, v_descale: with float8 (e4m3 / e5m2) q, k, v: fp32 (batch, nheads_kv) scales
            (the values are x * descale; flash_attn4.quantize_fp8 makes both); forward only, out bfloat16.

    Returns:
        out: (batch, seqlen_q, nheads_q, headdim), q's dtype; and, with return_lse,
        lse: (batch, nheads_q, seqlen_q) float32, natural log. A row that sees no key has out = 0, lse = -inf.

    The inputs are never modified. Gradients flow to q, k, v (and through lse): on Hopper through the
    sm90 kernels (windows and softcap included; options a kernel lacks fall back to the PyTorch reference
    with a warning), elsewhere through the reference.
    """
    if isinstance(q, Tensor) and q.dtype in fp8.FP8_DTYPES:
        if block_mask is not None or alibi_slopes is not None or dropout_p:
            raise NotImplementedError("fp8 attention takes causal, window_size, softcap and sinks so far")
        softmax_scale, left, right, softcap = _validate_options(
            q.shape[-1], causal, softmax_scale, window_size, softcap, return_lse, deterministic
        )
        out, lse = fp8.attn_fp8(
            q, k, v, q_descale, k_descale, v_descale, causal=causal, softmax_scale=softmax_scale,
            window_size=(left, right), softcap=softcap,
        )  # fmt: skip
        if sinks is not None:
            _validate_sinks(sinks, q.shape[2], q.device)
            out, lse = _with_sinks(out, lse, sinks, head_dim=1)
        return (out, lse) if return_lse else out
    _validate_tensors(q, k, v)
    softmax_scale, left, right, softcap = _validate_options(
        q.shape[-1], causal, softmax_scale, window_size, softcap, return_lse, deterministic
    )
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise TypeError(f"num_splits must be an int >= 0 (0 = choose, 1 = no split), got {num_splits!r}")
    _validate_sinks(sinks, q.shape[2], q.device)
    _validate_block_mask(block_mask, q.shape[1], k.shape[1], q.shape[0], q.shape[2], q.device)
    _validate_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device)
    dropout_p = _validate_dropout(dropout_p)
    if (
        block_mask is not None
        and alibi_slopes is None
        and dropout_p == 0
        and _block_sparse_kernel(q, k, v, block_mask, causal, left, right)
    ):
        m = block_mask
        out, lse = torch.ops.flash_attn4.fwd_block_sparse(
            q, k, v, m.kv_count, m.kv_index, m.full_count, m.full_index, m.q_count, m.q_index, m.full_q_count,
            m.full_q_index, softmax_scale, causal, left, right, softcap, deterministic,
        )  # fmt: skip
    elif alibi_slopes is not None and block_mask is None and dropout_p == 0 and not softcap:
        # The ALiBi op: sm90 kernels where built, else its own reference path (with a warning on CUDA).
        out, lse = torch.ops.flash_attn4.fwd_alibi(
            q, k, v, alibi_slopes, None, None, None, None, q.shape[1], k.shape[1], softmax_scale, causal,
            left, right, deterministic,
        )  # fmt: skip
    elif dropout_p > 0 and block_mask is None and alibi_slopes is None:
        # The dropout op: sm90 kernels where built, else its own reference path (with a warning on CUDA).
        out, lse = torch.ops.flash_attn4.fwd_dropout(
            q, k, v, draw_rng_state(q.device), dropout_p, None, None, None, None, q.shape[1], k.shape[1],
            softmax_scale, causal, left, right, softcap, deterministic,
        )  # fmt: skip
    elif block_mask is not None or alibi_slopes is not None or dropout_p > 0:
        out, lse = _general(q, k, v, block_mask, alibi_slopes, dropout_p, softmax_scale, causal, left, right,
                            softcap)  # fmt: skip
    elif sinks is not None and _ops_sinks.kernel_plan(q, k, v, causal, left, right, num_splits) is not None:
        # The forward kernels (sm90 and the Ampere path) fold the sinks into out and lse themselves.
        out, lse = torch.ops.flash_attn4.fwd_sinks(
            q, k, v, sinks, softmax_scale, causal, left, right, softcap, deterministic
        )
        return (out, lse) if return_lse else out
    else:
        fwd = _ops.fwd_impl if _ops.eager_direct(q, k, v) else torch.ops.flash_attn4.fwd
        out, lse = fwd(q, k, v, softmax_scale, causal, left, right, softcap, deterministic, num_splits)
    if sinks is not None:
        out, lse = _with_sinks(out, lse, sinks, head_dim=1)
    return (out, lse) if return_lse else out


def _validate_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    seqused_q: Any,
    seqused_k: Any,
) -> None:
    """Packed q (total_q, hq, d), k/v (total_k, hk, d) and their int32 offsets. Offsets are not read here:
    on CUDA that would synchronize the host; the op checks them where it reads them."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D (total_tokens, nheads, headdim) for attn_varlen, got shape "
                f"{tuple(t.shape)}; for padded (batch, seqlen, nheads, headdim) tensors use attn"
            )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must agree but in the last dim, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k must have the same headdim, got {q.shape[2]} and {k.shape[2]}")
    hq, hk = q.shape[1], k.shape[1]
    if hk < 1 or hq % hk != 0:
        raise ValueError(f"nheads of q ({hq}) must be a multiple of nheads of k and v ({hk}) (GQA/MQA)")
    _validate_device_rules(q.device.type, q.dtype, q.shape[2])
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype != torch.int32 or t.numel() < 1:
            raise TypeError(
                f"{name} must be a 1-D int32 tensor of batch + 1 offsets (0, len_0, len_0 + len_1, ...); "
                "build it with torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)"
            )
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
            f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}"
        )
    batch = cu_seqlens_q.numel() - 1
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is None:
            continue
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype != torch.int32 or t.numel() != batch:
            raise TypeError(
                f"{name} must be None or a 1-D int32 tensor of {batch} lengths (one per sequence)"
            )
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise TypeError(f"{name} must be a Python int >= 0 (the longest sequence), got {m!r}")


def attn_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    deterministic: bool = False,
    seqused_q: Tensor | None = None,
    seqused_k: Tensor | None = None,
    sinks: Tensor | None = None,
    num_splits: int = 0,
    dropout_p: float = 0.0,
    block_mask: Any = None,
    alibi_slopes: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over a packed batch of variable-length sequences (no padding).

    Args:
        q: (total_q, nheads_q, headdim); k, v: (total_k, nheads_kv, headdim), nheads_q % nheads_kv == 0.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 offsets: sequence i owns q rows
            [cu_seqlens_q[i], cu_seqlens_q[i+1]) and k/v rows [cu_seqlens_k[i], cu_seqlens_k[i+1]).
            Zero-length sequences are allowed.
        max_seqlen_q, max_seqlen_k: upper bounds of the sequence lengths (Python ints, FlashAttention's
            API): the CUDA kernels size their grids from them without reading the offsets on the host, so a
            sequence longer than its bound is not fully computed.
        seqused_q, seqused_k: optional (batch,) int32: only the first seqused rows of each sequence take part;
            query rows past seqused_q get out = 0 and lse = -inf.
        causal, softmax_scale, window_size, softcap, deterministic, sinks, num_splits, dropout_p: as for
            `attn`, per sequence (masks aligned to the bottom-right corner of each sequence; dropout counts
            sequence b as batch index b); short query blocks (max_seqlen_q x GQA group <= 64: decoding
            many sequences) run the split-KV decode kernel.
        block_mask: optional BlockMask built for (max_seqlen_q, max_seqlen_k), batch 1 or one entry per
            sequence: sequence b uses the top-left corner of its entry that its lengths cover.
        alibi_slopes: optional (nheads_q,) or (batch, nheads_q), as for `attn`, per sequence.

    Returns:
        out: (total_q, nheads_q, headdim); with return_lse also lse: (nheads_q, total_q) float32.

    The CUDA kernels (sm90 on Hopper, the Ampere path elsewhere) run it, forward and backward, reading the
    offsets on the device (no host synchronisation: the call can be captured in a CUDA graph and replayed
    with new offsets, provided the max_seqlen values still bound them). Without them the PyTorch reference
    runs. Gradients flow to q, k, v (and through lse).
    """
    _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    if checks.checks_enabled():
        checks.check_varlen(q.shape[0], k.shape[0], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            seqused_q, seqused_k)  # fmt: skip
    softmax_scale, left, right, softcap = _validate_options(
        q.shape[-1], causal, softmax_scale, window_size, softcap, return_lse, deterministic
    )
    _validate_sinks(sinks, q.shape[1], q.device)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise TypeError(f"num_splits must be an int >= 0 (0 = choose, 1 = no split), got {num_splits!r}")
    dropout_p = _validate_dropout(dropout_p)
    batch = cu_seqlens_q.numel() - 1
    _validate_block_mask(block_mask, max_seqlen_q, max_seqlen_k, batch, q.shape[1], q.device,
                         "max_seqlen_q, max_seqlen_k")  # fmt: skip
    _validate_alibi(alibi_slopes, batch, q.shape[1], q.device)
    if alibi_slopes is not None and block_mask is None and dropout_p == 0 and not softcap:
        out, lse = torch.ops.flash_attn4.fwd_alibi(
            q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
            max_seqlen_k, softmax_scale, causal, left, right, deterministic,
        )  # fmt: skip
        if sinks is not None:
            out, lse = _with_sinks(out, lse, sinks, head_dim=0)
        return (out, lse) if return_lse else out
    if dropout_p > 0 and block_mask is None and alibi_slopes is None:
        out, lse = torch.ops.flash_attn4.fwd_dropout(
            q, k, v, draw_rng_state(q.device), dropout_p, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            max_seqlen_q, max_seqlen_k, softmax_scale, causal, left, right, softcap, deterministic,
        )  # fmt: skip
        if sinks is not None:
            out, lse = _with_sinks(out, lse, sinks, head_dim=0)
        return (out, lse) if return_lse else out
    if dropout_p > 0 or block_mask is not None or alibi_slopes is not None:
        from flash_attn4._reference_general import general_varlen_ref
        from flash_attn4.dropout import draw_seed

        _warn_reference(q, dropout_p=dropout_p > 0 or None, block_mask=block_mask, alibi_slopes=alibi_slopes)
        out, lse = general_varlen_ref(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k, causal=causal,
            softmax_scale=softmax_scale, window_size=(left, right), softcap=softcap, block_mask=block_mask,
            alibi_slopes=alibi_slopes, dropout_p=dropout_p,
            dropout_seed=draw_seed(q.device) if dropout_p > 0 else (0, 0),
        )  # fmt: skip
        if sinks is not None:
            out, lse = _with_sinks(out, lse, sinks, head_dim=0)
        return (out, lse) if return_lse else out
    out, lse = torch.ops.flash_attn4.fwd_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_q,
        seqused_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        left,
        right,
        softcap,
        deterministic,
        num_splits,
    )
    if sinks is not None:
        out, lse = _with_sinks(out, lse, sinks, head_dim=0)
    return (out, lse) if return_lse else out
