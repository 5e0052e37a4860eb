"""Attention dropout's random numbers: counter-based (Philox, Salmon et al., Random123), so the keep mask of a
call is a pure function of (seed, offset, batch, head, row, column) that a kernel recomputes wherever it needs
it (forward and backward) and a test rebuilds exactly.

    stream of (b, h):  (k0, k1, ci, cj) = philox4x32_10((b * nheads + h, offset, 0, 0), (seed lo, seed hi))
    unit of x:         u(x) = (x >> 4) << 2 | (x & 7) >> 1      (x, x + 1, x + 8, x + 9 share a unit)
    bits:              (w0, w1, w2, w3) = philox4x32_7((u(i), ci, u(j), cj), (k0, k1))
    keep(b, h, i, j) = byte 2 * ((i >> 3) & 1) + ((j >> 3) & 1) of w[2 * (i & 1) + (j & 1)]  >=  threshold(p)

One Philox4x32 call (seven rounds, as FlashAttention-2's) serves the sixteen elements {i, i + 1, i + 8, i + 9}
x {j, j + 1, j + 8, j + 9} of a unit, one byte each. In the tensor cores' accumulator layout (sm90 WGMMA and
sm80 mma.sync alike) a thread holds rows {r, r + 8} and the lane four up holds rows {r + 1, r + 9}, each with
column pairs {c, c + 1} every 8 columns, whether rows are queries (S, the forward) or keys (S^T, the sm90
backward): so the two lanes of a pair each compute one unit of two neighbouring 16-column blocks and trade
the half the other holds (two shuffles), and no unit is computed twice in either direction.

The drop probability is p rounded to a multiple of 1 / 256 (threshold(p) / 256, as FlashAttention-2 rounds
it); kept probabilities are scaled by keep_scale(p) = 1 / (1 - threshold(p) / 256), so the expected output is
exactly the attention's.

Each call draws (seed, offset) from torch's default generator for the device (`draw_rng_state`), so a call is
reproducible under torch.manual_seed and two calls differ; the draw stays on the device (no host read), so a
call can be captured by torch.compile and CUDA graphs.
"""

from __future__ import annotations

import math

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


def _on_one_device(counter: tuple) -> list[Tensor]:
    """The counter words as int64 tensors on the device of the first tensor among them."""
    dev = next((c.device for c in counter if isinstance(c, Tensor)), torch.device("cpu"))
    return [torch.as_tensor(c, dtype=torch.int64, device=dev) for c in counter]


def philox4x32(counter: tuple, key: tuple, rounds: int = 10) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32 on broadcastable int64 tensors (or ints) holding 32-bit values; returns the four 32-bit
    output words (int64 tensors)."""
    c0, c1, c2, c3 = torch.broadcast_tensors(*_on_one_device(counter))
    k0, k1 = key
    for r in range(rounds):
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if r + 1 < rounds:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def threshold(p: float) -> int:
    """The 8-bit threshold the kernels compare with: p rounded to a multiple of 1 / 256 (at most 255)."""
    return min(math.floor(p * 256 + 0.5), 255)


def keep_scale(p: float) -> float:
    """What kept probabilities are multiplied by: 1 / (1 - the drop rate the kernels apply)."""
    return 256.0 / (256 - threshold(p))


def _unit(x: Tensor) -> Tensor:
    return ((x >> 4) << 2) | ((x & 7) >> 1)


def keep_mask(seed: int | Tensor, offset: int | Tensor, p: float, batch: int, nheads: int, rows: Tensor,
              cols: Tensor, *, batch_start: int = 0) -> Tensor:  # fmt: skip
    """bool (batch, nheads, len(rows), len(cols)): which probabilities survive dropout p, for sequences
    batch_start .. batch_start + batch - 1 and the given query rows and key columns (so a kernel's tile, or a
    reference's chunk, is a slice of the call's mask)."""
    dev = rows.device
    bh = torch.arange(batch_start * nheads, (batch_start + batch) * nheads, device=dev, dtype=torch.int64)
    seed, offset = (torch.as_tensor(x, dtype=torch.int64, device=dev) for x in (seed, offset))
    k0, k1, ci, cj = philox4x32((bh, offset & _MASK32, 0, 0), (seed & _MASK32, (seed >> 32) & _MASK32))
    k0, k1, ci, cj = (t.view(batch, nheads, 1, 1) for t in (k0, k1, ci, cj))
    i = rows.to(torch.int64).view(1, 1, -1, 1)
    j = cols.to(torch.int64).view(1, 1, 1, -1)
    w = philox4x32((_unit(i), ci, _unit(j), cj), (k0, k1), rounds=7)
    word = 2 * (i & 1) + (j & 1)
    word = torch.where(word == 0, w[0], torch.where(word == 1, w[1], torch.where(word == 2, w[2], w[3])))
    byte = 2 * ((i >> 3) & 1) + ((j >> 3) & 1)
    return ((word >> (8 * byte)) & 0xFF) >= threshold(p)


def draw_rng_state(device: torch.device) -> Tensor:
    """int64 (2,) on `device`: (seed, offset) for one call, drawn from torch's default generator there
    (advancing it), never read on the host. The kernels take it as a device pointer."""
    gen = None if device.type == "cpu" else torch.cuda.default_generators[device.index or 0]
    draws = torch.randint(0, 2**62, (2,), generator=gen, device=device)
    return draws & torch.tensor([2**62 - 1, _MASK32], device=device)


def draw_seed(device: torch.device) -> tuple[Tensor, Tensor]:
    """draw_rng_state as a (seed, offset) pair of 0-dim tensors."""
    rng = draw_rng_state(device)
    return rng[0], rng[1]
