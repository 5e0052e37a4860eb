"""Block-sparse attention (flash_attn4.BlockMask) as torch.library ops.

    flash_attn4::fwd_block_sparse(q, k, v, kv_count, kv_index, full_count, full_index, q_count,
                                  q_index, full_q_count, full_q_index, softmax_scale, causal,
                                  window_left, window_right, softcap, deterministic) -> (out, lse)
    flash_attn4::bwd_block_sparse(dout, dlse?, q, k, v, out, lse, <the same lists and options>)
                                  -> (dq, dk, dv)

Both directions run the block-sparse kernels (sm90, or the sm80 path; they walk the lists, so skipped
blocks cost nothing) where `kernel_plan` finds one, else the PyTorch reference (`_reference_general`). The
forward reads the query blocks' lists (kv_*, full_*), the backward their transpose (q_*, full_q_*: the query
blocks that read each key block), which BlockMask builds once. The block-sparse backward kernel has no
deterministic mode: with deterministic=True the gradients come from the reference (bitwise reproducible,
at dense cost or more).

No `from __future__ import annotations` here: custom_op reads the schema from real annotations.
"""

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from flash_attn4 import _build_info
from flash_attn4._ops import _kernel_plan, _Plan, _warn_once, bwd_into, fwd_into
from flash_attn4.block_mask import BLOCK, _dense


def kernel_plan(
    q: Tensor, k: Tensor, v: Tensor, block_size: int, causal: bool, window_left: int, window_right: int
) -> tuple[Optional[_Plan], str]:
    """The dense plan of the call when a block-sparse kernel can serve it, else (None, why)."""
    plan, why = _kernel_plan(q, q.shape[1], k.shape[1], causal, window_left, window_right, v.shape[-1])
    if plan is None:
        return None, why
    dpad = _build_info.padded_hdim(q.shape[-1])
    if dpad not in _build_info.BLOCK_SPARSE_HDIMS or block_size != BLOCK:
        return None, (
            f"the block-sparse kernels take {BLOCK}-token blocks at head dims "
            f"{_build_info.BLOCK_SPARSE_HDIMS or '(none built)'} (this call: block {block_size}, head dim "
            f"{q.shape[-1]}); the PyTorch reference runs"
        )
    return plan, ""


class _ListMask(NamedTuple):
    """What the reference reads of a BlockMask (`to_dense`, `block_size`), rebuilt from the op's lists."""

    kv_count: Tensor
    kv_index: Tensor
    full_count: Tensor
    full_index: Tensor
    block_size: int = BLOCK

    def to_dense(self) -> tuple[Tensor, Tensor]:
        nk = self.kv_index.shape[-1]
        return _dense(self.kv_count, self.kv_index, nk), _dense(self.full_count, self.full_index, nk)


def _reference(q, k, v, lists, softmax_scale, causal, window_left, window_right, softcap):
    from flash_attn4._reference_general import general_attention_ref

    return general_attention_ref(
        q, k, v, block_mask=_ListMask(*lists), causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap,
    )  # fmt: skip


@torch.library.custom_op("flash_attn4::fwd_block_sparse", mutates_args=())
def fwd_block_sparse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_count: Tensor,
    kv_index: Tensor,
    full_count: Tensor,
    full_index: Tensor,
    q_count: Tensor,
    q_index: Tensor,
    full_q_count: Tensor,
    full_q_index: Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """q (b, sq, hq, d), k / v (b, sk, hk, d) and a BlockMask's lists -> out (b, sq, hq, d), lse (b, hq, sq)
    (float32; float64 for float64 inputs on the reference). The transposed lists and `deterministic` are
    the backward's."""
    lists = (kv_count, kv_index, full_count, full_index)
    plan, why = kernel_plan(q, k, v, BLOCK, causal, window_left, window_right)
    if plan is None:
        if why and q.is_cuda:
            _warn_once(why)
        out, lse = _reference(q, k, v, lists, softmax_scale, causal, window_left, window_right, softcap)
        return out.contiguous(), lse.contiguous()
    b, sq, hq, d = q.shape
    out = q.new_empty(b, sq, hq, d)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    blocks = dict(zip(("block_kv_count", "block_kv_index", "block_full_count", "block_full_index"), lists))
    fwd_into(q, k, v, out, lse, softmax_scale, plan, softcap=softcap, blocks=blocks)
    return out, lse


@fwd_block_sparse.register_fake
def _fwd_fake(q, k, v, *lists_and_options):
    b, sq, hq, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(b, sq, hq, v.shape[-1]), q.new_empty(b, hq, sq, dtype=lse_dtype)


@torch.library.custom_op("flash_attn4::bwd_block_sparse", mutates_args=())
def bwd_block_sparse(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    kv_count: Tensor,
    kv_index: Tensor,
    full_count: Tensor,
    full_index: Tensor,
    q_count: Tensor,
    q_index: Tensor,
    full_q_count: Tensor,
    full_q_index: Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of fwd_block_sparse: the block-sparse kernel where kernel_plan finds one (and not
    deterministic), else the reference's, written out (general_bwd_ref)."""
    plan, why = kernel_plan(q, k, v, BLOCK, causal, window_left, window_right)
    if plan is not None and not deterministic and lse.dtype == torch.float32:
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        blocks = dict(zip(("block_q_count", "block_q_index", "block_full_q_count", "block_full_q_index"),
                          (q_count, q_index, full_q_count, full_q_index)))  # fmt: skip
        bwd_into(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, plan, dlse=dlse, softcap=softcap,
                 blocks=blocks)  # fmt: skip
        return dq, dk, dv
    if q.is_cuda and (why or deterministic):
        _warn_once(why or "flash_attn4: the block-sparse backward kernel has no deterministic mode; with "
                   "deterministic=True block-mask gradients come from the PyTorch reference")  # fmt: skip
    from flash_attn4._reference_general import general_bwd_ref

    mask = _ListMask(kv_count, kv_index, full_count, full_index)
    grads = general_bwd_ref(
        dout, dlse, q, k, v, block_mask=mask, causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap,
    )  # fmt: skip
    return tuple(g.contiguous() for g in grads)


@bwd_block_sparse.register_fake
def _bwd_fake(dout, dlse, q, k, v, *rest):
    return tuple(t.new_empty(t.shape) for t in (q, k, v))  # contiguous, as the implementation returns


_NUM_TENSORS = 11  # q, k, v and the eight lists


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:_NUM_TENSORS], *output)
    ctx.args = inputs[_NUM_TENSORS:]
    ctx.set_materialize_grads(False)


def _backward(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
    q, k, v, *lists, out, lse = ctx.saved_tensors
    dout = q.new_zeros(*q.shape[:-1], v.shape[-1]) if dout is None else dout
    dq, dk, dv = bwd_block_sparse(dout, dlse, q, k, v, out, lse, *lists, *ctx.args)
    return (dq, dk, dv) + (None,) * (_NUM_TENSORS - 3 + len(ctx.args))


fwd_block_sparse.register_autograd(_backward, setup_context=_setup_context)
