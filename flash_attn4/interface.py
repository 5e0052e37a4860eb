"""Public API: `attn(q, k, v, ...)`, FlashAttention conventions (DESIGN.md, 'Public Python API')."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import torch
from torch import Tensor

from flash_attn4 import _ops  # noqa: F401  (registers torch.ops.flash_attn4.*)

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
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
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
        deterministic: accepted for FlashAttention compatibility. The forward is always deterministic and
            so is the reference backward; it will select the deterministic CUDA backward once that exists.

    Returns:
        out: (batch, seqlen_q, nheads_q, headdim), q's dtype; and, with return_lse,
        lse: (batch, nheads_q, seqlen_q) float32, natural log. A row that sees no key has out = 0, lse = -inf.

    The inputs are never modified. Gradients flow to q, k, v (and through lse) on the reference path; on
    the CUDA kernel path the backward raises NotImplementedError until the Hopper backward kernel lands.
    """
    _validate_tensors(q, k, v)
    _validate_flags(causal=causal, return_lse=return_lse, deterministic=deterministic)
    left, right = _validate_window(window_size, causal)
    softcap = _validate_scalar("softcap", softcap, allow_zero=True)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    softmax_scale = _validate_scalar("softmax_scale", softmax_scale, allow_zero=False)
    out, lse = torch.ops.flash_attn4.fwd(q, k, v, softmax_scale, causal, left, right, softcap)
    return (out, lse) if return_lse else out
