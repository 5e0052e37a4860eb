"""Context parallelism for packed batches (`flash_attn4.distributed.ring_attn_varlen`).

    q, cu, max_len = zigzag_shard_varlen(q_packed, cu_seqlens, group=group)   # every sequence sharded
    k, _, _ = zigzag_shard_varlen(k_packed, cu_seqlens, group=group)
    v, _, _ = zigzag_shard_varlen(v_packed, cu_seqlens, group=group)
    out = ring_attn_varlen(q, k, v, cu, max_len, causal=True, group=group)

Every sequence of the batch is sharded on its own, zigzag: cut into 2 x world chunks, rank r keeps chunks r
and 2 world - 1 - r of each, in batch order. So every rank holds the same layout (each sequence's shard is
its length / world), its cu_seqlens are the batch's divided by world, and the ring runs as in `ring_attn`:
K / V blocks travel rank to rank, each rank attends its queries to the block it holds through the packed
kernels (`flash_attn4::fwd_varlen` / `bwd_varlen`), and the partials merge through their lse. Causal splits
a block into its sequences' first and second chunks (gathered rows), which see each other fully, causally
or not at all, as in the fixed-length form.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flash_attn4 import _ops_varlen
from flash_attn4.distributed import _merge, _pairs, _ring_backward_loop, _ring_forward_loop, _world


def zigzag_shard_varlen(x: Tensor, cu_seqlens: Tensor, *, group=None) -> tuple[Tensor, Tensor, int]:
    """This rank's shard of a packed tensor x (total, ...) whose sequences cu_seqlens (batch + 1,) delimits:
    chunks r and 2 world - 1 - r of every sequence's 2 world equal chunks, in batch order. Returns (shard,
    the shard's cu_seqlens (cu_seqlens / world, int32, on cu_seqlens' device), its longest sequence). Every
    length must be divisible by 2 x world. Reads cu_seqlens on the host."""
    r, w = _world(group)
    cu = cu_seqlens.tolist()
    pieces = []
    for a, b in zip(cu, cu[1:]):
        if (b - a) % (2 * w):
            raise ValueError(f"zigzag sharding needs every sequence length divisible by 2 x world ({2 * w}); "
                             f"one has {b - a}")  # fmt: skip
        c = (b - a) // (2 * w)
        pieces += [x[a + r * c : a + (r + 1) * c], x[a + (2 * w - 1 - r) * c : a + (2 * w - r) * c]]
    shard = torch.cat(pieces) if pieces else x[:0]
    lens = [(b - a) // w for a, b in zip(cu, cu[1:])]
    return shard, torch.div(cu_seqlens, w, rounding_mode="floor").to(torch.int32), max(lens, default=0)


def zigzag_unshard_varlen(x: Tensor, cu_seqlens: Tensor, *, group=None) -> Tensor:
    """The full packed tensor from every rank's `zigzag_shard_varlen` shard; cu_seqlens: the whole batch's."""
    _, w = _world(group)
    shards = [torch.empty_like(x) for _ in range(w)]
    torch.distributed.all_gather(shards, x.contiguous(), group=group)
    cu = cu_seqlens.tolist()
    out = []
    for a, b in zip(cu, cu[1:]):
        s0, c = a // w, (b - a) // (2 * w)  # the sequence's start in every shard, and its chunk length
        chunks = [None] * (2 * w)
        for i, sh in enumerate(shards):
            chunks[i], chunks[2 * w - 1 - i] = sh[s0 : s0 + c], sh[s0 + c : s0 + 2 * c]
        out += chunks
    return torch.cat(out) if out else x[:0]


def _halves(cu: list[int], device) -> tuple[Tensor, Tensor]:
    """Row indices of every sequence's first and second local chunk."""
    first = [torch.arange(a, a + (b - a) // 2) for a, b in zip(cu, cu[1:])]
    second = [torch.arange(a + (b - a) // 2, b) for a, b in zip(cu, cu[1:])]
    cat = lambda parts: (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).to(device)  # noqa: E731
    return cat(first), cat(second)


class _Layout:
    """The shard's sub-blocks that rank r computes against the block of rank `owner`: (query rows, key rows,
    causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window left, window right), one packed
    kernel call each; rows None = all."""

    def __init__(self, cu_seqlens: Tensor, max_len: int, causal: bool, world: int, window=(-1, -1)):
        self.cu, self.max_len, self.causal, self.world = cu_seqlens, int(max_len), causal, world
        self.window = tuple(window)
        if causal:
            self.halves = _halves(cu_seqlens.tolist(), cu_seqlens.device)
            self.cu_half = torch.div(cu_seqlens, 2, rounding_mode="floor").to(torch.int32)

    def blocks(self, r: int, owner: int):
        if self.window != (-1, -1):
            return self._window_blocks(r, owner)
        if not self.causal:
            return [(None, None, False, self.cu, self.cu, self.max_len, self.max_len, -1, -1)]
        w, (first, second) = self.world, self.halves
        q_chunks = ((r, first), (2 * w - 1 - r, second))
        k_chunks = ((owner, first), (2 * w - 1 - owner, second))
        half = self.max_len // 2
        return [(qi, ki, a == c, self.cu_half, self.cu_half, half, half, -1, -1)
                for a, qi in q_chunks for c, ki in k_chunks if a >= c]  # fmt: skip

    def _window_blocks(self, r: int, owner: int):
        """Windows: every sequence's zigzag chunk pairs trimmed to the band (distributed._pairs), whose
        windows depend on the sequence's chunk length. Blocks with the same window and chunk pair (so no
        query row twice) share one call, each block a sequence of it; a block the band misses is skipped."""
        groups: dict[tuple, list] = {}
        cu = self.cu.tolist()
        for a, b in zip(cu, cu[1:]):
            n, half = b - a, (b - a) // 2
            if n == 0:
                continue
            for qs, ks, wl, wr in _pairs(r, owner, self.world, self.causal, n, n, *self.window, zigzag=True):
                key = (wl, wr, qs.start >= half, ks.start >= half)
                groups.setdefault(key, []).append((a + qs.start, a + qs.stop, a + ks.start, a + ks.stop))
        out = []
        dev = self.cu.device
        for (wl, wr, _, _), blocks in groups.items():
            qi = torch.cat([torch.arange(q0, q1) for q0, q1, _, _ in blocks]).to(dev)
            ki = torch.cat([torch.arange(k0, k1) for _, _, k0, k1 in blocks]).to(dev)
            lq, lk = [q1 - q0 for q0, q1, _, _ in blocks], [k1 - k0 for _, _, k0, k1 in blocks]
            cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32,
                                       device=dev) for ls in (lq, lk))  # fmt: skip
            out.append((qi, ki, False, cu_q, cu_k, max(lq), max(lk), wl, wr))
        return out


def _rows(t: Tensor, idx) -> Tensor:
    return t if idx is None else t.index_select(0, idx)


def _cols(t: Tensor, idx) -> Tensor:
    return t if idx is None else t.index_select(1, idx)


def _ring_fwd(q, k, v, layout, scale, softcap, group):
    r, _ = _world(group)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=cdt, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=cdt, device=q.device)

    def step(owner, kb, vb):
        for qi, ki, c, cu_q, cu_k, mq, mk, wl, wr in layout.blocks(r, owner):
            o, l_ = _ops_varlen.fwd_varlen(
                _rows(q, qi), _rows(kb, ki), _rows(vb, ki), cu_q, cu_k, None, None, mq, mk, scale, c, wl, wr,
                softcap, False,
            )  # fmt: skip
            o_m, l_m = _merge(_rows(out, qi)[None], _cols(lse, qi)[None], o.to(cdt)[None], l_.to(cdt)[None])
            if qi is None:
                out.copy_(o_m[0])
                lse.copy_(l_m[0])
            else:
                out[qi], lse[:, qi] = o_m[0], l_m[0]

    _ring_forward_loop(k, v, group, step)
    return out, lse


def _ring_bwd(dout, dlse, q, k, v, out, lse, layout, scale, softcap, group):
    r, _ = _world(group)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)

    def step(owner, kb, vb, dkb, dvb):
        for qi, ki, c, cu_q, cu_k, mq, mk, wl, wr in layout.blocks(r, owner):
            dl = None if dlse is None else _cols(dlse, qi).contiguous()
            gq, gk, gv = _ops_varlen.bwd_varlen(
                _rows(dout, qi).contiguous(), dl, _rows(q, qi), _rows(kb, ki), _rows(vb, ki),
                _rows(out, qi).contiguous(), _cols(lse, qi).contiguous(), cu_q, cu_k, None, None, mq, mk,
                scale, c, wl, wr, softcap, False,
            )  # fmt: skip
            for acc, idx, g in ((dq, qi, gq), (dkb, ki, gk), (dvb, ki, gv)):
                if idx is None:
                    acc += g.to(cdt)
                else:
                    acc.index_add_(0, idx, g.to(cdt))

    dk, dv = _ring_backward_loop(k, v, cdt, group, step)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttnVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, scale, softcap, group):
        out, lse = _ring_fwd(q, k, v, layout, scale, softcap, group)
        ctx.save_for_backward(q, k, v, out.to(q.dtype) if q.is_cuda else out, lse)
        ctx.args = (layout, scale, softcap, group)
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dlse = None if dlse is None else dlse.to(lse.dtype)
        dq, dk, dv = _ring_bwd(dout, dlse, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


def ring_attn_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, group=None, causal: bool = False,
    softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    return_lse: bool = False,
):  # fmt: skip
    """Self-attention of this rank's shard of a packed batch over the whole sharded batch. q (total_shard,
    nheads_q, d), k / v (total_shard, nheads_kv, d), cu_seqlens (batch + 1,) int32 and max_seqlen: the
    shard's (the same on every rank; `zigzag_shard_varlen` gives them). causal=True and windows need zigzag
    shards; otherwise any equal split of every sequence works. window_size as for `attn_varlen` over each
    whole sequence: a chunk pair the window misses is skipped, one it cuts runs trimmed, with the chunk
    pairs of equal windows in one call. Returns this rank's out (total_shard, nheads_q, d)
    (and lse (nheads_q, total_shard)); differentiable in q, k, v and through lse. Reads cu_seqlens on the
    host."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D (total_shard, nheads, headdim) tensor")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError("ring_attn_varlen is self-attention: q, k and v share the shard's rows")
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise TypeError("cu_seqlens must be a 1-D int32 tensor (the shard's, from zigzag_shard_varlen)")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must run from 0 to the shard's {q.shape[0]} rows, non-decreasing")
    from flash_attn4.interface import _validate_window

    window = _validate_window(window_size, causal)
    window = (-1, -1) if window == (-1, 0 if causal else -1) else window  # causal alone: no window
    if (causal or window != (-1, -1)) and any((b - a) % 2 for a, b in zip(cu, cu[1:])):
        raise ValueError(
            "causal or windowed ring_attn_varlen takes zigzag shards (two equal chunks a sequence)"
        )
    _, w = _world(group)
    layout = _Layout(cu_seqlens.to(q.device), max(int(max_seqlen), 1), bool(causal), w, window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = _RingAttnVarlen.apply(q, k, v, layout, scale, float(softcap), group)
    return (out, lse) if return_lse else out
