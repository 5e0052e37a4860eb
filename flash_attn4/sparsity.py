"""A run-time estimate of which blocks of the attention matrix matter: `estimate_block_mask(q, k)`.

Approximate by design. Each block of `block` queries (keys) is represented by its mean query (key); the
mean query's softmax over the mean keys, weighted by each key block's size, estimates how much of a query
block's attention mass each key block holds. Per query block it keeps the fewest key blocks whose
estimated mass reaches `threshold` (or the top `density` fraction of the visible ones), plus the first
`keep_first` key blocks (attention sinks) and the `keep_local` blocks at the diagonal. Blocks the causal /
window mask hides entirely are never kept; kept blocks the mask covers entirely are marked full. The cost
is a pass over q and k plus (seqlen / block)^2 dot products per head: small beside the attention itself.
docs/design.md ("Block sparsity") has measured errors of the output against dense attention.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flash_attn4.block_mask import BLOCK, BlockMask


def _pool(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """x (b, s, h, d) -> (block means (b, h, n, d) float32, rows per block (n,))."""
    b, s, h, d = x.shape
    n = math.ceil(s / block)
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, n * block - s))
    sums = padded.view(b, n, block, h, d).sum(dim=2)
    rows = torch.full((n,), float(block), device=x.device)
    rows[-1] = s - (n - 1) * block
    return (sums / rows[None, :, None, None]).transpose(1, 2), rows


def block_visibility(sq: int, sk: int, block: int, causal: bool, window_size, device) -> tuple[Tensor, ...]:
    """(any, all) bool (nq, nk): whether the causal / window mask (bottom-right aligned) lets some / every
    element of a block through. Computed from the band's edges, never densely."""
    nq, nk = math.ceil(sq / block), math.ceil(sk / block)
    off = sk - sq
    r0 = torch.arange(nq, device=device)[:, None] * block + off
    r1 = torch.clamp(torch.arange(nq, device=device)[:, None] * block + block, max=sq) - 1 + off
    c0 = torch.arange(nk, device=device)[None, :] * block
    c1 = torch.clamp(torch.arange(nk, device=device)[None, :] * block + block, max=sk) - 1
    left, right = window_size
    right = 0 if causal else right
    some = torch.ones(nq, nk, dtype=torch.bool, device=device)
    every = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if right >= 0:
        some &= r1 + right >= c0
        every &= r0 + right >= c1
    if left >= 0:
        some &= r0 - left <= c1
        every &= r1 - left <= c0
    return some, every


def estimate_block_mask(
    q: Tensor, k: Tensor, *, threshold: float | None = None, density: float | None = None,
    block: int = BLOCK, keep_first: int = 1, keep_local: int = 1, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
) -> BlockMask:  # fmt: skip
    """A BlockMask for attn(q, k, v, causal=..., window_size=..., block_mask=...) from q (b, sq, hq, d) and
    k (b, sk, hk, d); exactly one of threshold (estimated mass to keep per query block, in (0, 1]) and
    density (fraction of the visible key blocks to keep, in (0, 1]). Batch and heads are kept separate."""
    if (threshold is None) == (density is None):
        raise ValueError("pass exactly one of threshold (mass to keep, e.g. 0.95) and density (e.g. 0.1)")
    for name, val in (("threshold", threshold), ("density", density)):
        if val is not None and not 0 < val <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {val}")
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError("q must be (batch, seqlen_q, nheads_q, d) and k (batch, seqlen_k, nheads_kv, d)")
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if hk < 1 or hq % hk:
        raise ValueError(f"nheads of q ({hq}) must be a multiple of nheads of k ({hk})")
    scale = 1 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    qp, _ = _pool(q.detach(), block)
    kp, key_rows = _pool(k.detach(), block)
    kp = kp.repeat_interleave(hq // hk, dim=1)
    some, every = block_visibility(sq, sk, block, causal, window_size, q.device)
    logits = torch.einsum("bhnd,bhmd->bhnm", qp, kp) * scale + key_rows.log()
    logits = logits.masked_fill(~some, -math.inf)
    mass = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # query blocks that see nothing: all 0
    nq, nk = some.shape

    order = mass.argsort(dim=-1, descending=True)
    sorted_mass = mass.gather(-1, order)
    if threshold is not None:
        before = sorted_mass.cumsum(-1) - sorted_mass  # mass of the better blocks
        keep_sorted = before < threshold - 1e-6
    else:
        n_keep = (some.sum(-1) * density).ceil().clamp(min=1)  # (nq,)
        keep_sorted = (torch.arange(nk, device=q.device) < n_keep[:, None]).expand_as(order)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)

    cols = torch.arange(nk, device=q.device)
    diag = (torch.clamp(torch.arange(nq, device=q.device) * block + block, max=sq) - 1 + sk - sq) // block
    forced = (cols[None, :] < keep_first) | (
        (cols[None, :] <= diag[:, None]) & (cols[None, :] > diag[:, None] - keep_local)
    )
    keep = (keep | forced) & some
    return BlockMask.from_dense(keep, sq, sk, full=keep & every, block_size=block)
