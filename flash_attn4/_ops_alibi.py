"""ALiBi attention (`alibi_slopes`) as torch.library ops, fixed-length and packed batches in one pair:

    flash_attn4::fwd_alibi(q, k, v, alibi_slopes, cu_seqlens_q?, cu_seqlens_k?, seqused_q?, seqused_k?,
                           max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                           deterministic) -> (out, lse)
    flash_attn4::bwd_alibi(dout, dlse?, q, k, v, alibi_slopes, out, lse, <the same>) -> (dq, dk, dv)

Without cu_seqlens, q is (b, sq, hq, d) and lse (b, hq, sq); with them, q is packed (total_q, hq, d) and lse
(hq, total_q), as in `_ops` / `_ops_varlen`. The logit of query i and key j gains
-slope * |i + seqlen_k - seqlen_q - j| per sequence. Both directions run the sm90 ALiBi kernels (the Alibi
score bias) where `kernel_plan` finds one, else the PyTorch reference (`_reference_general`). The slopes get
no gradient (FlashAttention's convention: they are fixed per head).

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
    window_left: int, window_right: int,
) -> tuple[Optional[_Plan], str]:  # fmt: skip
    """The plan of an ALiBi call when an ALiBi kernel can serve it, else (None, why; "" if nothing to do)."""
    plan, why = _option_ops.base_plan(q, k, v, packed, max_seqlen_q, max_seqlen_k, causal, window_left,
                                      window_right)  # fmt: skip
    if plan is None:
        return None, why
    if plan.arch != 90 or _build_info.padded_hdim(q.shape[-1]) not in _build_info.ALIBI_HDIMS:
        return None, (
            f"the ALiBi kernels are sm90 ones, built at head dims {_build_info.ALIBI_HDIMS or '(none)'} "
            f"(this call: sm{plan.arch}, head dim {q.shape[-1]}); the PyTorch reference runs"
        )
    return plan, ""


def _reference_fwd(q, k, v, slopes, cu_q, cu_k, used_q, used_k, scale, causal, left, right):
    from flash_attn4._reference_general import general_attention_ref, general_varlen_ref

    if cu_q is None:
        return general_attention_ref(q, k, v, alibi_slopes=slopes, causal=causal, softmax_scale=scale,
                                     window_size=(left, right), softcap=0.0)  # fmt: skip
    return general_varlen_ref(q, k, v, cu_q, cu_k, seqused_q=used_q, seqused_k=used_k, causal=causal,
                              softmax_scale=scale, window_size=(left, right), softcap=0.0,
                              alibi_slopes=slopes)  # fmt: skip


def _reference_bwd(dout, dlse, q, k, v, slopes, cu_q, cu_k, used_q, used_k, scale, causal, left, right):
    """general_bwd_ref, per sequence for a packed batch (general_varlen_bwd_ref)."""
    from flash_attn4._reference_general import general_bwd_ref, general_varlen_bwd_ref

    opts = dict(causal=causal, softmax_scale=scale, window_size=(left, right), softcap=0.0)
    if cu_q is None:
        return general_bwd_ref(dout, dlse, q, k, v, alibi_slopes=slopes, **opts)
    per_sequence = lambda b: {"alibi_slopes": slopes[b] if slopes.dim() == 2 else slopes}  # noqa: E731
    return general_varlen_bwd_ref(dout, dlse, q, k, v, cu_q, cu_k, used_q, used_k, per_sequence=per_sequence,
                                  **opts)  # fmt: skip


@torch.library.custom_op("flash_attn4::fwd_alibi", mutates_args=())
def fwd_alibi(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alibi_slopes: Tensor,
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
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """ALiBi forward -> out like q (v's head dim), lse (b, hq, sq) or packed (hq, total_q); float32 (float64
    for float64 inputs on the reference). `deterministic` is the backward's."""
    packed = cu_seqlens_q is not None
    plan, why = kernel_plan(q, k, v, packed, max_seqlen_q, max_seqlen_k, causal, window_left, window_right)
    if plan is None:
        if why and q.is_cuda:
            _warn_once(why)
        out, lse = _reference_fwd(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                  softmax_scale, causal, window_left, window_right)  # fmt: skip
        return out.contiguous(), lse.contiguous()
    out, lse = _option_ops.kernel_outputs(q, v, packed)
    varlen = _varlen(packed, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    fwd_into(q, k, v, out, lse, softmax_scale, plan, varlen=varlen, alibi_slopes=alibi_slopes)
    return out, lse


@fwd_alibi.register_fake
def _fwd_fake(q, k, v, alibi_slopes, cu_seqlens_q, *rest):
    return _option_ops.fake_outputs(q, v, cu_seqlens_q is not None)


@torch.library.custom_op("flash_attn4::bwd_alibi", mutates_args=())
def bwd_alibi(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alibi_slopes: Tensor,
    out: Tensor,
    lse: Tensor,
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
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of fwd_alibi (through lse too): the ALiBi backward kernel where kernel_plan finds one, else
    the reference's, written out (general_bwd_ref)."""
    packed = cu_seqlens_q is not None
    plan, why = kernel_plan(q, k, v, packed, max_seqlen_q, max_seqlen_k, causal, window_left, window_right)
    if plan is not None and lse.dtype == torch.float32:
        dq, dk, dv = _option_ops.kernel_grads(q, k, v, packed)
        varlen = _varlen(packed, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
        bwd_into(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, plan, deterministic, dlse, varlen=varlen,
                 alibi_slopes=alibi_slopes)  # fmt: skip
        return dq, dk, dv
    if why and q.is_cuda:
        _warn_once(why)
    grads = _reference_bwd(dout, dlse, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q,
                           seqused_k, softmax_scale, causal, window_left, window_right)  # fmt: skip
    return _option_ops.reference_grads(grads, q, k, v, packed)


@bwd_alibi.register_fake
def _bwd_fake(dout, dlse, q, k, v, alibi_slopes, out, lse, cu_seqlens_q, *rest):
    return _option_ops.fake_grads(q, k, v, cu_seqlens_q is not None)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, slopes, cu_q, cu_k, used_q, used_k, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, slopes, out, lse)
    ctx.seqs = (cu_q, cu_k, used_q, used_k)  # int32 offsets: never differentiated
    ctx.args = tuple(args)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
    q, k, v, slopes, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv = bwd_alibi(dout, dlse, q, k, v, slopes, out, lse, *ctx.seqs, *ctx.args)
    return (dq, dk, dv) + (None,) * 12


fwd_alibi.register_autograd(_backward, setup_context=_setup_context)
