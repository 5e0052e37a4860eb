"""Attention dropout's random numbers: a counter-based generator (Philox4x32-10), so the keep mask of a
call is a pure function of (seed, offset, batch, head, row, column) that a kernel can recompute anywhere
(forward and backward, any tiling) and a test can rebuild exactly.

    key     = (seed mod 2^32, seed >> 32)
    counter = (column // 4, row, batch * nheads + head, offset)
    keep(b, h, i, j) = philox(key, counter)[j % 4] >= p * 2^32      (dropped with probability p)

Each call draws (seed, offset) from torch's default generator for the device (`draw_seed`), so a call is
reproducible under torch.manual_seed and two calls differ; the draw stays on the device (no host read), so a
call can be captured by torch.compile and CUDA graphs. Kept probabilities are scaled by 1 / (1 - p).
"""

from __future__ import annotations

import torch
from torch import Tensor

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32 = 0xFFFFFFFF


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit halves of a * m for 32-bit a (int64 tensor) and constant m, exactly in int64: the
    operands are split into 16-bit halves so no partial product overflows."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    m_hi, m_lo = m >> 16, m & 0xFFFF
    lo_lo = a_lo * m_lo
    mid = a_hi * m_lo + a_lo * m_hi + (lo_lo >> 16)  # < 2^34
    lo = ((mid & 0xFFFF) << 16) | (lo_lo & 0xFFFF)
    hi = a_hi * m_hi + (mid >> 16)
    return hi & _MASK32, lo & _MASK32


def philox4x32(counter: tuple[Tensor, Tensor, Tensor, Tensor], key: tuple[int, int], rounds: int = 10):
    """Philox4x32 (Salmon et al., Random123) on broadcastable int64 tensors holding 32-bit values; returns the
    four 32-bit output words (int64 tensors)."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)
    k0, k1 = key
    for r in range(rounds):
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if r + 1 < rounds:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def keep_mask(seed: int | Tensor, offset: int | Tensor, p: float, batch: int, nheads: int, rows: Tensor,
              cols: Tensor, *, batch_start: int = 0) -> Tensor:  # fmt: skip
    """bool (batch, nheads, len(rows), len(cols)): which probabilities survive dropout p, for sequences
    batch_start .. batch_start + batch - 1 and the given query rows and key columns (so a kernel's tile, or a
    reference's chunk, is a slice of the call's mask)."""
    dev = rows.device
    bh = torch.arange(batch_start * nheads, (batch_start + batch) * nheads, device=dev, dtype=torch.int64)
    bh = bh.view(batch, nheads, 1, 1)
    i = rows.to(torch.int64).view(1, 1, -1, 1)
    j = cols.to(torch.int64).view(1, 1, 1, -1)
    seed, offset = (torch.as_tensor(x, dtype=torch.int64, device=dev) for x in (seed, offset))
    words = philox4x32((j // 4, i, bh, offset & _MASK32), (seed & _MASK32, (seed >> 32) & _MASK32))
    lane = j % 4
    r = torch.where(
        lane == 0, words[0], torch.where(lane == 1, words[1], torch.where(lane == 2, words[2], words[3]))
    )
    return r >= min(int(p * 2**32), 2**32 - 1)


def draw_seed(device: torch.device) -> tuple[Tensor, Tensor]:
    """(seed, offset) for one call: 0-dim int64 tensors on `device` drawn from torch's default generator
    there (advancing it), never read on the host."""
    gen = None if device.type == "cpu" else torch.cuda.default_generators[device.index or 0]
    draws = torch.randint(0, 2**62, (2,), generator=gen, device=device)
    return draws[0], draws[1] & _MASK32
