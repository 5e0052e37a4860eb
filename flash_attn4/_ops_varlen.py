"""torch.library custom ops for packed (variable-length) batches: `flash_attn4::fwd_varlen` and
`flash_attn4::bwd_varlen`, on the same path decisions and kernel calls as the dense ops in `_ops`.

No `from __future__ import annotations` here: custom_op reads the schema from real annotations.
"""

from typing import Optional

import torch
from torch import Tensor

from flash_attn4 import _ops_kvcache, _varlen_decode, reference
from flash_attn4._ops import _kernel_plan, _lse_dtype, _Plan, _tma_ready, _warn_once, bwd_into, fwd_into

# Variable-length (packed) batches. The kernels serve them (they read cu_seqlens on the device, so there is no
# host synchronisation and the op can be captured in a CUDA graph); elsewhere reference.attention_varlen_ref
# runs, which reads cu_seqlens on the host.


def _varlen_plan(
    q: Tensor,
    k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    window_left: int,
    window_right: int,
    head_dim_v: Optional[int] = None,
    mla: bool = False,
) -> tuple[Optional[_Plan], str]:
    """`_kernel_plan` of a packed call: the max_seqlen bounds stand for the lengths (a window side that masks
    nothing at the longest sequence masks nothing at any)."""
    if k.shape[0] == 0:
        return None, ""
    return _kernel_plan(q, max_seqlen_q, max_seqlen_k, causal, window_left, window_right, head_dim_v, mla=mla)


def _varlen_args_if(packed, cu_q, cu_k, used_q, used_k, max_q, max_k):
    """_varlen_args for a packed call, None for a fixed-length one (the option ops serve both)."""
    return _varlen_args(cu_q, cu_k, used_q, used_k, max_q, max_k) if packed else None


def _varlen_args(cu_q, cu_k, used_q, used_k, max_q, max_k) -> dict:
    return {
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
        "seqused_q": used_q,
        "seqused_k": used_k,
        "max_seqlen_q": int(max_q),
        "max_seqlen_k": int(max_k),
    }


@torch.library.custom_op("flash_attn4::fwd_varlen", mutates_args=())
def fwd_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
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
    num_splits: int = 0,
) -> tuple[Tensor, Tensor]:
    """Varlen forward. q (total_q, hq, d), k/v (total_k, hk, d) -> out like q, lse (hq, total_q).

    Rows outside every sequence (past seqused_q, or past cu_seqlens_q[-1]) get out = 0 and lse = -inf.
    Short query blocks (max_seqlen_q x GQA group <= DECODE_MAX_ROWS) and forced num_splits > 1 run the
    split-KV decode kernel (`_varlen_decode`); its out and lse feed the same backward.
    """
    plan, why = _varlen_plan(
        q, k, max_seqlen_q, max_seqlen_k, causal, window_left, window_right, v.shape[-1], mla=True
    )
    mla = v.shape[-1] != q.shape[-1]  # the decode kernels take one head dim
    if (
        plan is not None
        and not mla
        and _ops_kvcache.use_decode(max_seqlen_q, q.shape[1], k.shape[1], q.shape[2], num_splits, q.device)
    ):
        return _decode_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                              softmax_scale, plan, softcap, num_splits)  # fmt: skip
    if plan is not None:
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        fwd_into(
            q,
            k,
            v,
            out,
            lse,
            softmax_scale,
            plan,
            softcap=softcap,
            varlen=_varlen_args(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k),
        )
        return out, lse
    if why and q.is_cuda:
        _warn_once(why)
    out, lse = reference.attention_varlen_ref(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_q=seqused_q,
        seqused_k=seqused_k,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=(window_left, window_right),
        softcap=softcap,
    )
    return out.contiguous(), lse.contiguous()


def _decode_varlen(q, k, v, cu_q, cu_k, used_q, used_k, max_q, softmax_scale, plan, softcap, num_splits):
    c = _varlen_decode.as_cache(q, k, v, cu_q, cu_k, used_q, used_k, max_q)
    qb = c["q_block"]
    out = torch.empty_like(qb)
    lse = torch.empty(qb.shape[0], qb.shape[2], qb.shape[1], dtype=torch.float32, device=q.device)
    _ops_kvcache.decode_into(
        qb, _tma_ready(c["k_cache"]), _tma_ready(c["v_cache"]), out, lse, softmax_scale, plan.causal,
        plan.window_left, plan.window_right, softcap, num_splits, cache_seqlens=c["cache_seqlens"],
        cache_batch_idx=c["cache_batch_idx"], cache_leftpad=c["cache_leftpad"],
    )  # fmt: skip
    return _varlen_decode.scatter_back(out, lse, c["rows"], c["valid"], q.shape[0])


@fwd_varlen.register_fake
def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *args):
    total_q, hq, _ = q.shape
    return q.new_empty(total_q, hq, v.shape[-1]), torch.empty(
        hq, total_q, dtype=_lse_dtype(q.dtype), device=q.device
    )


@torch.library.custom_op("flash_attn4::bwd_varlen", mutates_args=())
def bwd_varlen(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
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
    """Varlen backward: dq like q, dk like k, dv like v (zero outside every sequence); through lse too."""
    plan, why = _varlen_plan(
        q, k, max_seqlen_q, max_seqlen_k, causal, window_left, window_right, v.shape[-1], mla=True
    )
    if plan is not None:
        # Zeros: the kernel writes only rows inside the sequences.
        dq, dk, dv = (torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        bwd_into(
            dout,
            q,
            k,
            v,
            out,
            lse,
            dq,
            dk,
            dv,
            softmax_scale,
            plan,
            deterministic,
            dlse,
            softcap=softcap,
            varlen=_varlen_args(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k),
        )
        return dq, dk, dv
    if why and q.is_cuda:
        _warn_once(why)
    if dlse is None:
        dlse = torch.zeros(q.shape[1], q.shape[0], dtype=_lse_dtype(q.dtype), device=q.device)
    grads = reference.attention_varlen_bwd_ref(
        dout,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        dlse=dlse,
        seqused_q=seqused_q,
        seqused_k=seqused_k,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=(window_left, window_right),
        softcap=softcap,
        out=out,  # the forward's, used where exact (fp32 / fp64): P from its lse, D from it
        lse=lse,
    )
    return tuple(g.contiguous() for g in grads)


@bwd_varlen.register_fake
def _bwd_varlen_fake(dout, dlse, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context_varlen(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, used_q, used_k, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.used = (used_q, used_k)
    ctx.args = tuple(args[:8])  # max_seqlen_q .. deterministic: what bwd_varlen takes (not num_splits)
    ctx.set_materialize_grads(False)


def _backward_varlen(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv = bwd_varlen(dout, dlse, q, k, v, out, lse, cu_q, cu_k, *ctx.used, *ctx.args)
    return (dq, dk, dv) + (None,) * 13


fwd_varlen.register_autograd(_backward_varlen, setup_context=_setup_context_varlen)
