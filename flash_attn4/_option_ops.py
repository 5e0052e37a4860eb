"""Pieces shared by the option ops (`_ops_alibi`, `_ops_dropout`), whose one op pair serves fixed-length
batches, q (b, sq, hq, d) with lse (b, hq, sq), and packed ones, q (total_q, hq, d) with lse (hq, total_q)."""

from __future__ import annotations

import torch
from torch import Tensor

from flash_attn4._ops import _grad_like, _in_grad_layout, _kernel_plan, _lse_dtype, _Plan


def base_plan(
    q: Tensor, k: Tensor, v: Tensor, packed: bool, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    window_left: int, window_right: int,
) -> tuple[_Plan | None, str]:  # fmt: skip
    """`_kernel_plan` of the call (packed: the max_seqlen bounds stand for the lengths), before the option's
    own conditions."""
    if packed and k.shape[0] == 0:
        return None, ""
    sq, sk = (max_seqlen_q, max_seqlen_k) if packed else (q.shape[1], k.shape[1])
    return _kernel_plan(q, sq, sk, causal, window_left, window_right, v.shape[-1])


def kernel_outputs(q: Tensor, v: Tensor, packed: bool) -> tuple[Tensor, Tensor]:
    """out and lse for the forward kernel (packed: zeros and -inf; it writes the sequences' rows only)."""
    if packed:
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        return out, torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    b, sq, hq, _ = q.shape
    return q.new_empty(b, sq, hq, v.shape[-1]), torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)


def kernel_grads(q: Tensor, k: Tensor, v: Tensor, packed: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv for the backward kernel: packed, zeros, since it writes the sequences' rows only."""
    if packed:
        return tuple(torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    return tuple(_grad_like(t) for t in (q, k, v))


def reference_grads(grads, q: Tensor, k: Tensor, v: Tensor, packed: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The reference backward's gradients in the layouts the fake kernels promise."""
    if packed:
        return tuple(g.contiguous() for g in grads)
    return tuple(_in_grad_layout(g, t) for g, t in zip(grads, (q, k, v)))


def fake_outputs(q: Tensor, v: Tensor, packed: bool) -> tuple[Tensor, Tensor]:
    if packed:
        total_q, hq, _ = q.shape
        return q.new_empty(total_q, hq, v.shape[-1]), q.new_empty(hq, total_q, dtype=_lse_dtype(q.dtype))
    b, sq, hq, _ = q.shape
    return q.new_empty(b, sq, hq, v.shape[-1]), q.new_empty(b, hq, sq, dtype=_lse_dtype(q.dtype))


def fake_grads(q: Tensor, k: Tensor, v: Tensor, packed: bool) -> tuple[Tensor, Tensor, Tensor]:
    if packed:
        return tuple(t.new_empty(t.shape) for t in (q, k, v))
    return _grad_like(q), _grad_like(k), _grad_like(v)
