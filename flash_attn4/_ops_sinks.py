"""Attention sinks folded into the forward kernels (sm90 and the Ampere path), fixed-length batches:

    flash_attn4::fwd_sinks(q, k, v, sinks, softmax_scale, causal, window_left, window_right, softcap,
                           deterministic) -> (out, lse)       # both with the sinks

The kernels fold each head's sink into its finished rows (csrc/common/softmax.hpp, apply_sink), so no pass
over out follows them. The backward needs nothing new for q, k, v: with the sinked out and lse, P and D are
the sinked attention's, which `flash_attn4::bwd` differentiates (through lse too); d sinks is
-sum over rows of exp(sink - lse) (D - dlse) with D = rowsum(dout * out), where the backward kernel's pre-pass
hands back D - dlse (`flash_attn4::bwd_sinks`). Without a forward kernel for the call (or where the decode
kernel takes it) the ops run the reference and the same merge (`_sinks.merge`, `_sinks.sinks_grad`).

No `from __future__ import annotations` here: custom_op reads the schema from real annotations.
"""

from typing import Optional

import torch
from torch import Tensor

from flash_attn4 import _ops, _ops_kvcache, _sinks


def kernel_plan(q: Tensor, k: Tensor, v: Tensor, causal: bool, window_left: int, window_right: int,
                num_splits: int = 0) -> Optional[_ops._Plan]:  # fmt: skip
    """The plan when a forward kernel (sm90 or the Ampere path) takes the call with its sinks (not the decode
    kernels), else None."""
    plan, _ = _ops._kernel_plan(q, q.shape[1], k.shape[1], causal, window_left, window_right, v.shape[-1])
    if plan is None:
        return None
    if _ops_kvcache.use_decode(q.shape[1], q.shape[2], k.shape[2], q.shape[3], num_splits, q.device):
        return None
    return plan


@torch.library.custom_op("flash_attn4::fwd_sinks", mutates_args=())
def fwd_sinks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """q (b, sq, hq, d), k / v (b, sk, hk, d), sinks (hq,) -> out (b, sq, hq, d), lse (b, hq, sq), with the
    sinks (lse float32; float64 for float64 inputs on the reference)."""
    plan = kernel_plan(q, k, v, causal, window_left, window_right)
    if plan is None:
        out, lse = _ops.fwd_impl(q, k, v, softmax_scale, causal, window_left, window_right, softcap, False)
        out, lse, _ = _sinks.merge(out, lse, sinks, head_dim=1)
        return out.contiguous(), lse.contiguous()
    b, sq, hq, d = q.shape
    out = q.new_empty(b, sq, hq, d)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    _ops.fwd_into(q, k, v, out, lse, softmax_scale, plan, softcap=softcap, sinks=sinks)
    return out, lse


@fwd_sinks.register_fake
def _fwd_fake(q, k, v, sinks, *args):
    b, sq, hq, _ = q.shape
    return q.new_empty(b, sq, hq, v.shape[-1]), q.new_empty(b, hq, sq, dtype=_ops._lse_dtype(q.dtype))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, sinks, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, out, lse)
    ctx.args = tuple(args)
    ctx.set_materialize_grads(False)


@torch.library.custom_op("flash_attn4::bwd_sinks", mutates_args=())
def bwd_sinks(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    sinks: Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of fwd_sinks: (dq, dk, dv, d sinks). On the kernel, d sinks comes from the D - dlse the
    backward's pre-pass computes anyway (no pass of our own over out and dout)."""
    plan = kernel_plan(q, k, v, causal, window_left, window_right)
    if plan is None:
        d_sinks = _sinks.sinks_grad(dout, dlse, out, lse, sinks)
        # The reference backward takes P from the given lse and D from the given out only in its compute
        # dtype (else it recomputes them, without the sinks): hand it an exact out.
        grads = _ops.bwd(dout, dlse, q, k, v, out.to(lse.dtype), lse, softmax_scale, causal, window_left,
                         window_right, softcap, deterministic)  # fmt: skip
        return (*grads, d_sinks)
    dq, dk, dv = (_ops._grad_like(t) for t in (q, k, v))
    args = (softmax_scale, plan, deterministic, dlse)
    d_minus_dlse = _ops.bwd_into(dout, q, k, v, out, lse, dq, dk, dv, *args, softcap=softcap)
    b, sq, hq, _ = q.shape
    g = d_minus_dlse.view(b, hq, -1)[:, :, :sq]
    return dq, dk, dv, _sinks.sinks_grad_from(g, lse, sinks)


@bwd_sinks.register_fake
def _bwd_fake(dout, dlse, q, k, v, out, lse, sinks, *args):
    return _ops._grad_like(q), _ops._grad_like(k), _ops._grad_like(v), torch.empty_like(sinks)


def _backward(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
    q, k, v, sinks, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv, d_sinks = bwd_sinks(dout, dlse, q, k, v, out, lse, sinks, *ctx.args)
    return dq, dk, dv, d_sinks, None, None, None, None, None, None


fwd_sinks.register_autograd(_backward, setup_context=_setup_context)
