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

import functools
import math

import torch
from torch import Tensor

from flash_attn4 import _build_info
from flash_attn4.block_mask import BLOCK, BlockMask


def _pooled_sums(x: Tensor, block: int) -> Tensor:
    """x (b, s, h, d) -> per-block sums (b, n, h, d) float32, read once in x's dtype (no float copy of x)."""
    s = x.shape[1]
    whole = s // block
    parts = []
    if whole:
        parts.append(x[:, : whole * block].unflatten(1, (whole, block)).sum(2, dtype=torch.float32))
    if s % block:
        parts.append(x[:, whole * block :].sum(1, keepdim=True, dtype=torch.float32))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _rows(s: int, block: int, device) -> Tensor:
    """Tokens per block (n,) float32: block, and what is left in the last one."""
    n = math.ceil(s / block)
    return torch.tensor([float(block)] * (n - 1) + [float(s - (n - 1) * block)], device=device)


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


def _kernel(q: Tensor, k: Tensor, block: int):
    """The extension when its estimate_blocks serves the call (csrc/sparse_estimate.cu: four launches), else
    None (the PyTorch version below: CPU tensors, float64, no extension, or more key blocks than a row of
    shared memory holds)."""
    if not (q.is_cuda and {q.dtype, k.dtype} <= _KERNEL_DTYPES and q.shape[1] and k.shape[1]):
        return None
    if (math.ceil(k.shape[1] / block) + q.shape[-1]) * 4 > 48 * 1024:
        return None
    ext, _ = _build_info.load_extension()
    return ext if hasattr(ext, "estimate_blocks") else None


_KERNEL_DTYPES = {torch.float32, torch.float16, torch.bfloat16}


@functools.lru_cache(maxsize=32)
def _geometry(sq: int, sk: int, block: int, causal: bool, window_size, keep_first: int, keep_local: int,
              density: float | None, device) -> tuple:  # fmt: skip
    """What depends on the shapes and options alone, made once: (masked, some, hidden, every, edge, forced,
    n_keep), all (nq, nk) bool but n_keep ((nq, 1) float, density only): whether the mask touches any block,
    the blocks it lets through somewhere / hides entirely / covers entirely / cuts (some but not every), the
    blocks always kept (the first keep_first, keep_local at the diagonal), and how many blocks each query
    block keeps under `density`."""
    some, every = block_visibility(sq, sk, block, causal, window_size, device)
    nq, nk = some.shape
    cols = torch.arange(nk, device=device)
    diag = (torch.clamp(torch.arange(nq, device=device) * block + block, max=sq) - 1 + sk - sq) // block
    forced = (cols[None, :] < keep_first) | (
        (cols[None, :] <= diag[:, None]) & (cols[None, :] > diag[:, None] - keep_local)
    )
    forced &= some
    # In float64, as the kernel (and math.ceil below) count it.
    n_keep = None if density is None else (some.sum(-1, keepdim=True).double() * density).ceil().clamp(min=1)
    # every <= some: where every block is covered, none is hidden.
    return not bool(every.all()), some, ~some, every, some & ~every, forced, n_keep


def estimate_block_mask(
    q: Tensor, k: Tensor, *, threshold: float | None = None, density: float | None = None,
    block: int = BLOCK, keep_first: int = 1, keep_local: int = 1, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
) -> BlockMask:  # fmt: skip
    """A BlockMask for attn(q, k, v, causal=..., window_size=..., block_mask=...) from q (b, sq, hq, d) and
    k (b, sk, hk, d); exactly one of threshold (estimated mass to keep per query block, in (0, 1]) and
    density (fraction of the visible key blocks to keep, in (0, 1]). Batch and heads are kept separate.

    CUDA q and k (float32 / float16 / bfloat16) run three kernels (csrc/sparse_estimate.cu); elsewhere about
    30 tensor operations on small tensors after one pass over q and k, with the geometry (which blocks the
    mask hides or covers, which are always kept) cached per shape and options. Both rank blocks the same
    way; they can differ only where rounding moves a block's mass across the threshold."""
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
    ext = _kernel(q, k, block)
    if ext is not None:
        left, right = window_size
        right = 0 if causal else right
        args = (scale, threshold or 0.0, density or 0.0, keep_first, keep_local, left, right, block)
        return BlockMask(sq, sk, *ext.estimate_blocks(q.detach(), k.detach(), *args), block)
    masked, some, hidden, every, edge, forced, n_keep = _geometry(
        sq, sk, block, causal, tuple(window_size), keep_first, keep_local, density, q.device
    )
    nq, nk = hidden.shape

    # Block means: sums over the block's tokens; equal blocks fold 1 / block into the scale.
    qs, ks = _pooled_sums(q.detach(), block), _pooled_sums(k.detach(), block)
    if sq % block:
        qs = qs / _rows(sq, block, q.device)[:, None, None]
    if sk % block:
        ks = ks / _rows(sk, block, q.device)[:, None, None]
    scale = scale / ((block if sq % block == 0 else 1) * (block if sk % block == 0 else 1))
    # Query heads of one KV head against its pooled keys, without repeating them: (b, hk, g, nq, nk).
    logits = torch.einsum("bnkgd,bmkd->bkgnm", qs.unflatten(2, (hk, hq // hk)), ks).reshape(b, hq, nq, nk)
    logits = (
        logits.mul_(scale) if sk % block == 0 else logits.mul_(scale).add_(_rows(sk, block, q.device).log())
    )
    if masked:
        logits.masked_fill_(hidden, -math.inf)
    mass = torch.softmax(logits, dim=-1)
    if masked:
        mass.nan_to_num_(0.0)  # query blocks that see nothing: all 0

    if threshold is not None:
        sorted_mass, order = mass.sort(dim=-1, descending=True)
        keep_sorted = sorted_mass.cumsum(-1).sub_(sorted_mass) < threshold - 1e-6  # the better blocks' mass
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    elif not masked:
        top = mass.topk(max(1, math.ceil(nk * density)), dim=-1).indices  # every row sees all nk blocks
        keep = torch.zeros(mass.shape, dtype=torch.bool, device=q.device).scatter_(-1, top, True)
    else:
        order = mass.argsort(dim=-1, descending=True)
        keep_sorted = torch.arange(nk, device=q.device) < n_keep  # (nq, nk)
        keep = torch.zeros(mass.shape, dtype=torch.bool, device=q.device).scatter_(
            -1, order, keep_sorted.expand(mass.shape)
        )
    keep |= forced
    if not masked:  # every block full: no element mask anywhere
        return BlockMask._build(torch.zeros_like(keep), keep, sq, sk, block)
    keep &= some
    # Kept blocks the mask covers entirely need no element mask; those it cuts take it.
    return BlockMask._build(keep & edge, keep & every, sq, sk, block)
