"""Context parallelism: attention over a sequence sharded across the ranks of a torch.distributed group.

    q, k, v = (zigzag_shard(t, group=group) for t in (q, k, v))     # causal: balanced shards
    out = ring_attn(q, k, v, causal=True, group=group)               # this rank's shard of the output

Each rank holds its shard of q, k and v, (batch, seqlen / world, heads, d). K and V travel around the ring
(rank r sends to r + 1, receives from r - 1) while each rank attends its queries to the block it holds; the
partial results merge through their log-sum-exps (merge_attn_states' math). The backward recomputes nothing:
with the merged out and lse, each block's gradients are those of the attention kernel's backward, dq stays
on the rank and dk / dv travel with their block back to its owner. Causal attention shards zigzag: the
sequence is cut into 2 x world chunks and rank r holds chunks r and 2 world - 1 - r, so every rank has the
same amount of work; blocks above the diagonal are skipped. Works on any backend with point-to-point sends
(NCCL on GPUs, gloo on CPU, where the reference kernels run).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from flash_attn4 import _ops

__all__ = [
    "ring_attn",
    "ring_attn_varlen",
    "zigzag_shard",
    "zigzag_shard_varlen",
    "zigzag_unshard",
    "zigzag_unshard_varlen",
]


def _world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def zigzag_shard(x: Tensor, *, group=None, dim: int = 1) -> Tensor:
    """This rank's zigzag shard of the full tensor x: chunks r and 2 world - 1 - r of 2 world equal chunks
    along `dim` (the sequence dim must be divisible by 2 world)."""
    r, w = _world(group)
    if x.shape[dim] % (2 * w):
        raise ValueError(f"zigzag sharding needs seqlen ({x.shape[dim]}) divisible by 2 x world ({2 * w})")
    chunks = x.chunk(2 * w, dim=dim)
    return torch.cat([chunks[r], chunks[2 * w - 1 - r]], dim=dim)


def zigzag_unshard(x: Tensor, *, group=None, dim: int = 1) -> Tensor:
    """The full tensor from every rank's zigzag shard (an all-gather, then the chunks back in order)."""
    r, w = _world(group)
    shards = [torch.empty_like(x) for _ in range(w)]
    dist.all_gather(shards, x.contiguous(), group=group)
    chunks = [None] * (2 * w)
    for i, s in enumerate(shards):
        chunks[i], chunks[2 * w - 1 - i] = s.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def _start_exchange(tensors: list[Tensor], group, tag: int = 0) -> tuple[list, list[Tensor]]:
    """Starts sending `tensors` to the next rank and receiving the previous rank's (same shapes); returns
    (requests, receive buffers). The transfers run while the caller computes (on NCCL's own stream on
    GPUs, on gloo's threads on CPU); `_finish` waits for them. The sends and receives go in one
    batch_isend_irecv, which on NCCL is one group call, so they progress together: issued one by one, with
    two ranks (next and previous the same peer) each rank's send would sit ahead of its receive on the
    pair's stream, waiting for the peer's receive, which sits behind the peer's own send. Message i
    carries tag + i (gloo matches tags; NCCL matches in issue order, the same on every rank), so exchanges
    in flight together (a step's K / V and the previous block's gradients) never match each other's."""
    r, w = _world(group)
    nxt, prv = (r + 1) % w, (r - 1) % w
    nxt, prv = (dist.get_global_rank(group, i) if group is not None else i for i in (nxt, prv))
    received = [torch.empty_like(t) for t in tensors]
    sent = [t.contiguous() for t in tensors]  # kept alive with the requests until they are waited on
    ops = [dist.P2POp(dist.isend, t, nxt, group=group, tag=tag + i) for i, t in enumerate(sent)] + [
        dist.P2POp(dist.irecv, t, prv, group=group, tag=tag + i) for i, t in enumerate(received)
    ]
    return [(req, sent) for req in dist.batch_isend_irecv(ops)], received


def _finish(requests) -> None:
    for req, _ in requests:
        req.wait()


def _band_block(lo: int | None, hi: int | None, nq: int, nk: int):
    """An nq x nk block of queries i and keys j (local indices) of which only lo <= j - i <= hi is attended
    (None: unbounded): (query slice, key slice, window left, window right) of the smallest sub-block holding
    every such pair, with the window in the kernels' convention (bottom-right aligned, -1 unbounded, both
    sides >= 0 after the trim), or None when the block holds no pair. Queries that see no key of the block
    and keys no query sees are trimmed, which is what makes both sides nonnegative."""
    if (lo is not None and lo > nk - 1) or (hi is not None and hi < -(nq - 1)):
        return None
    q0 = 0 if hi is None else max(0, -hi)
    q1 = nq if lo is None else min(nq, nk - lo)
    k0 = 0 if lo is None else max(0, q0 + lo)
    k1 = nk if hi is None else min(nk, q1 + hi)
    # The trimmed block's diagonal offset; its band is [lo - s, hi - s] with s = k0 - q0.
    d = (k1 - k0) - (q1 - q0)
    left = -1 if lo is None or lo <= -(nq - 1) else d - (lo - (k0 - q0))
    right = -1 if hi is None or hi >= nk - 1 else (hi - (k0 - q0)) - d
    return slice(q0, q1), slice(k0, k1), left, right


def _pairs(r: int, owner: int, w: int, causal: bool, sq: int, sk: int, left: int = -1, right: int = -1,
           zigzag: bool | None = None):  # fmt: skip
    """The (query slice, key slice, window left, window right) sub-blocks rank r computes against the block
    of rank `owner`, for a global window (left, right) (causal: right 0). Contiguous shards: one block,
    queries from r * sq, keys from owner * sk. Zigzag (causal, or `zigzag`): rank r's queries are chunks
    (r, 2w-1-r), owner's keys chunks (owner, 2w-1-owner), each sq / 2 long; chunk a sees chunk c fully when
    a > c (unless the window cuts it), causally when a == c, not at all when a < c."""
    if causal:
        right = 0
    if causal if zigzag is None else zigzag:
        hq, hk = sq // 2, sk // 2
        q_chunks = ((r * hq, slice(0, hq)), ((2 * w - 1 - r) * hq, slice(hq, sq)))
        k_chunks = ((owner * hk, slice(0, hk)), ((2 * w - 1 - owner) * hk, slice(hk, sk)))
    else:
        q_chunks, k_chunks = ((r * sq, slice(0, sq)),), ((owner * sk, slice(0, sk)),)
    out = []
    for qo, qs in q_chunks:
        for ko, ks in k_chunks:
            # Global j - i in [-left, right] is local j' - i' in [qo - ko - left, qo - ko + right].
            lo = None if left < 0 else qo - ko - left
            hi = None if right < 0 else qo - ko + right
            b = _band_block(lo, hi, qs.stop - qs.start, ks.stop - ks.start)
            if b is not None:
                bq, bk, wl, wr = b
                out.append((slice(qs.start + bq.start, qs.start + bq.stop),
                            slice(ks.start + bk.start, ks.start + bk.stop), wl, wr))  # fmt: skip
    return out


def _merge(out: Tensor, lse: Tensor, o: Tensor, l_: Tensor) -> tuple[Tensor, Tensor]:
    """Running (out, lse) merged with a partial (o, l_); out (b, s, h, d), lse (b, h, s)."""
    new = torch.logaddexp(lse, l_)
    new_safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - new_safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(l_ - new_safe).transpose(1, 2).unsqueeze(-1)
    return out * w_old + o * w_new, new


def _ring_forward_loop(k: Tensor, v: Tensor, group, step) -> None:
    """The forward's ring: step(owner, kb, vb) with the K / V block of rank `owner`, world times, while the
    next block travels in (rank r holds rank r - s's block at step s)."""
    r, w = _world(group)
    kv = [k, v]
    for s in range(w):
        pending, nxt = _start_exchange(kv, group) if s + 1 < w else ([], None)  # the next block, meanwhile
        step((r - s) % w, *kv)
        _finish(pending)
        kv = nxt


def _ring_backward_loop(k: Tensor, v: Tensor, cdt, group, step) -> tuple[Tensor, Tensor]:
    """The backward's ring: step(owner, kb, vb, dkb, dvb) adds this rank's share of the block's gradients
    into dkb, dvb; K / V of the next step travel while it computes, the gradients follow once complete and
    after world moves are back with their owner. Returns this rank's dk, dv (in cdt)."""
    r, w = _world(group)
    block = [
        k,
        v,
        torch.zeros(k.shape, dtype=cdt, device=k.device),
        torch.zeros(v.shape, dtype=cdt, device=v.device),
    ]
    for s in range(w):
        kb, vb, dkb, dvb = block
        pending, kv_next = _start_exchange([kb, vb], group) if s + 1 < w else ([], [None, None])
        step((r - s) % w, kb, vb, dkb, dvb)
        grad_reqs, grads_next = _start_exchange([dkb, dvb], group, tag=2)
        _finish(pending + grad_reqs)
        block = kv_next + grads_next
    return block[2], block[3]


def _ring_fwd(q, k, v, scale, causal, window, softcap, group):
    r, w = _world(group)
    b, sq, hq, _ = q.shape
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(b, sq, hq, v.shape[-1], dtype=cdt, device=q.device)
    lse = torch.full((b, hq, sq), -math.inf, dtype=cdt, device=q.device)

    def step(owner, kb, vb):
        for qs, ks, wl, wr in _pairs(r, owner, w, causal, sq, k.shape[1], *window):
            o, l_ = _ops.fwd_impl(q[:, qs], kb[:, ks], vb[:, ks], scale, False, wl, wr, softcap, False)
            out[:, qs], lse[:, :, qs] = _merge(out[:, qs], lse[:, :, qs], o.to(cdt), l_.to(cdt))

    _ring_forward_loop(k, v, group, step)
    return out, lse  # in the compute dtype: the backward's D needs the unrounded out


def _ring_bwd(dout, dlse, q, k, v, out, lse, scale, causal, window, softcap, group):
    r, w = _world(group)
    sq = q.shape[1]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)

    def step(owner, kb, vb, dkb, dvb):
        for qs, ks, wl, wr in _pairs(r, owner, w, causal, sq, k.shape[1], *window):
            # Every block's P uses the merged lse, so the lse gradient enters each block's backward whole.
            dl = None if dlse is None else dlse[:, :, qs].contiguous()
            gq, gk, gv = _ops.bwd(
                dout[:, qs].contiguous(), dl, q[:, qs], kb[:, ks], vb[:, ks], out[:, qs].contiguous(),
                lse[:, :, qs].contiguous(), scale, False, wl, wr, softcap, False,
            )  # fmt: skip
            dq[:, qs] += gq.to(cdt)
            dkb[:, ks] += gk.to(cdt)
            dvb[:, ks] += gv.to(cdt)

    dk, dv = _ring_backward_loop(k, v, cdt, group, step)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window, softcap, group):
        out, lse = _ring_fwd(q, k, v, scale, causal, window, softcap, group)
        # The kernels' backward takes out in q's dtype; the reference uses an unrounded one exactly.
        ctx.save_for_backward(q, k, v, out.to(q.dtype) if q.is_cuda else out, lse)
        ctx.args = (scale, causal, window, softcap, group)
        ctx.set_materialize_grads(False)  # an unused lse then gives dlse None
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dlse = None if dlse is None else dlse.to(lse.dtype)
        dq, dk, dv = _ring_bwd(dout, dlse, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def ring_attn(
    q: Tensor, k: Tensor, v: Tensor, *, group=None, causal: bool = False, softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, return_lse: bool = False,
):  # fmt: skip
    """Attention of this rank's query shard over the whole sharded sequence. q (batch, seqlen_shard,
    nheads_q, d), k / v (batch, seqlen_shard, nheads_kv, d), the same shard length on every rank: contiguous
    shards for causal=False, zigzag shards (`zigzag_shard`) for causal=True; window_size and softcap as for
    `attn` over the whole sequence (a block the window misses is skipped, one it cuts runs with the window
    in its local coordinates). Returns this rank's shard of out (and of lse, (batch, nheads_q,
    seqlen_shard)). Differentiable in q, k, v (and through lse)."""
    from flash_attn4.interface import _validate_window

    window = _validate_window(window_size, causal)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (batch, seqlen_shard, nheads, headdim) tensor")
    if causal and (q.shape[1] % 2 or k.shape[1] % 2):
        raise ValueError("causal ring_attn takes zigzag shards (two equal chunks): even shard lengths")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = _RingAttn.apply(q, k, v, scale, bool(causal), window, float(softcap), group)
    return (out, lse) if return_lse else out


from flash_attn4._ring_varlen import (  # noqa: E402  (the packed form builds on the helpers above)
    ring_attn_varlen,
    zigzag_shard_varlen,
    zigzag_unshard_varlen,
)
