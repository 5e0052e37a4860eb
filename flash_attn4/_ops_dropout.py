"""Attention dropout (`dropout_p`) as torch.library ops, fixed-length and packed batches in one pair:

    flash_attn4::fwd_dropout(q, k, v, rng, dropout_p, cu_seqlens_q?, cu_seqlens_k?, seqused_q?, seqused_k?,
                             max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                             softcap, deterministic) -> (out, lse)
    flash_attn4::bwd_dropout(dout, dlse?, q, k, v, rng, out, lse, dropout_p, <the same>) -> (dq, dk, dv)

`rng` is the call's int64 (2,) (seed, offset) on q's device (flash_attn4.dropout.draw_rng_state): an input,
so the op is a pure function of its arguments (the backward recomputes the forward's keep mask from it) and a
captured graph reads a fresh draw each replay. Both directions run the sm90 dropout kernels (the Dropout score
modifier) where `kernel_plan` finds one, else the PyTorch reference (`_reference_general`), bit-identical
keep masks either way. Layouts as in `_ops_alibi`.

No `from __future__ import annotations` here: custom_op reads the schema from real annotations.
"""

from typing import Optional

import torch
from torch import Tensor

from flash_attn4 import _build_info, _option_ops
from flash_attn4._ops import _Plan, _warn_once, bwd_into, fwd_into
from flash_attn4._ops_varlen import _varlen_args_if as _varlen


def kernel_plan(
    q: Tensor, k: Tensor, v: Tensor, packed: bool, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    window_left: int, window_right: int, softcap: float,
) -> tuple[Optional[_Plan], str]:  # fmt: skip
    """The plan of a dropout call when a dropout kernel can serve it, else (None, why; "" if nothing to
    do)."""
    plan, why = _option_ops.base_plan(q, k, v, packed, max_seqlen_q, max_seqlen_k, causal, window_left,
                                      window_right)  # fmt: skip
    if plan is None:
        return None, why
    if plan.arch != 90 or _build_info.padded_hdim(q.shape[-1]) not in _build_info.DROPOUT_HDIMS or softcap:
        return None, (
            f"the dropout kernels are sm90 ones without softcap, built at head dims "
            f"{_build_info.DROPOUT_HDIMS or '(none)'} (this call: sm{plan.arch}, head dim {q.shape[-1]}"
            f"{', softcap' if softcap else ''}); the PyTorch reference runs"
        )
    return plan, ""


def _opts(p, rng, scale, causal, left, right, softcap) -> dict:
    return dict(causal=causal, softmax_scale=scale, window_size=(left, right), softcap=softcap, dropout_p=p,
                dropout_seed=(rng[0], rng[1]))  # fmt: skip


def _reference_fwd(q, k, v, rng, p, cu_q, cu_k, used_q, used_k, scale, causal, left, right, softcap):
    from flash_attn4._reference_general import general_attention_ref, general_varlen_ref

    opts = _opts(p, rng, scale, causal, left, right, softcap)
    if cu_q is None:
        return general_attention_ref(q, k, v, **opts)
    return general_varlen_ref(q, k, v, cu_q, cu_k, seqused_q=used_q, seqused_k=used_k, **opts)


def _reference_bwd(
    dout, dlse, q, k, v, rng, p, cu_q, cu_k, used_q, used_k, scale, causal, left, right, softcap
):
    """general_bwd_ref, per sequence for a packed batch (general_varlen_bwd_ref; sequence b is batch b of
    the keep mask)."""
    from flash_attn4._reference_general import general_bwd_ref, general_varlen_bwd_ref

    opts = _opts(p, rng, scale, causal, left, right, softcap)
    if cu_q is None:
        return general_bwd_ref(dout, dlse, q, k, v, **opts)
    return general_varlen_bwd_ref(dout, dlse, q, k, v, cu_q, cu_k, used_q, used_k,
                                  per_sequence=lambda b: {"dropout_batch": b}, **opts)  # fmt: skip


@torch.library.custom_op("flash_attn4::fwd_dropout", mutates_args=())
def fwd_dropout(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rng: Tensor,
    dropout_p: float,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    seqused_q: Optional[Tensor],
    seqused_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """Dropout forward -> out like q, lse (b, hq, sq) or packed (hq, total_q) of the probabilities before
    dropout; float32 (float64 for float64 inputs on the reference). `deterministic` is the backward's."""
    packed = cu_seqlens_q is not None
    plan, why = kernel_plan(q, k, v, packed, max_seqlen_q, max_seqlen_k, causal, window_left, window_right,
                            softcap)  # fmt: skip
    if plan is None:
        if why and q.is_cuda:
            _warn_once(why)
        out, lse = _reference_fwd(q, k, v, rng, dropout_p, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                  softmax_scale, causal, window_left, window_right, softcap)  # fmt: skip
        return out.contiguous(), lse.contiguous()
    out, lse = _option_ops.kernel_outputs(q, v, packed)
    varlen = _varlen(packed, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    fwd_into(q, k, v, out, lse, softmax_scale, plan, varlen=varlen, dropout=(dropout_p, rng))
    return out, lse


@fwd_dropout.register_fake
def _fwd_fake(q, k, v, rng, dropout_p, cu_seqlens_q, *rest):
    return _option_ops.fake_outputs(q, v, cu_seqlens_q is not None)


@torch.library.custom_op("flash_attn4::bwd_dropout", mutates_args=())
def bwd_dropout(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rng: Tensor,
    out: Tensor,
    lse: Tensor,
    dropout_p: float,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    seqused_q: Optional[Tensor],
    seqused_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of fwd_dropout (through lse too), with the forward's keep mask recomputed from rng: the
    dropout backward kernel where kernel_plan finds one, else the reference's, written out
    (general_bwd_ref)."""
    packed = cu_seqlens_q is not None
    plan, why = kernel_plan(q, k, v, packed, max_seqlen_q, max_seqlen_k, causal, window_left, window_right,
                            softcap)  # fmt: skip
    if plan is not None and lse.dtype == torch.float32:
        dq, dk, dv = _option_ops.kernel_grads(q, k, v, packed)
        varlen = _varlen(packed, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
        bwd_into(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, plan, deterministic, dlse, varlen=varlen,
                 dropout=(dropout_p, rng))  # fmt: skip
        return dq, dk, dv
    if why and q.is_cuda:
        _warn_once(why)
    grads = _reference_bwd(dout, dlse, q, k, v, rng, dropout_p, cu_seqlens_q, cu_seqlens_k, seqused_q,
                           seqused_k, softmax_scale, causal, window_left, window_right, softcap)  # fmt: skip
    return _option_ops.reference_grads(grads, q, k, v, packed)


@bwd_dropout.register_fake
def _bwd_fake(dout, dlse, q, k, v, rng, out, lse, dropout_p, cu_seqlens_q, *rest):
    return _option_ops.fake_grads(q, k, v, cu_seqlens_q is not None)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, rng, p, cu_q, cu_k, used_q, used_k, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, rng, out, lse)
    ctx.p = p
    ctx.seqs = (cu_q, cu_k, used_q, used_k)  # int32 offsets: never differentiated
    ctx.args = tuple(args)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
    q, k, v, rng, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv = bwd_dropout(dout, dlse, q, k, v, rng, out, lse, ctx.p, *ctx.seqs, *ctx.args)
    return (dq, dk, dv) + (None,) * 14


fwd_dropout.register_autograd(_backward, setup_context=_setup_context)
