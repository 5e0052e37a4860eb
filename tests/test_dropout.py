"""Attention dropout (`dropout_p`): the Philox4x32-10 generator against Random123's known answers; the keep
mask's units, rate and independence from the tiling; a call reproduced by torch.manual_seed and equal,
forward and gradients, to dense fp64 attention with the same keep mask applied; packed batches count
sequence b as batch b."""

from __future__ import annotations

import math

import pytest
import torch

import flash_attn4
from flash_attn4 import compat, dropout


@pytest.mark.parametrize(
    "counter,key,want",
    [  # Random123 kat_vectors, philox4x32_10
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ],
)  # fmt: skip
def test_philox_known_answers(counter, key, want):
    words = dropout.philox4x32(tuple(torch.tensor(c) for c in counter), key)
    assert tuple(int(w) for w in words) == want


def test_keep_mask_units_and_neighbours():
    """The sixteen elements {i, i + 1, i + 8, i + 9} x {j, j + 1, j + 8, j + 9} of a unit are one seven-round
    Philox4x32 call's sixteen bytes; and neighbours are independent: adjacent pairs are both kept at
    (1 - p)^2, in rows, columns and across units."""
    p = 0.25
    keep = dropout.keep_mask(5, 9, p, 1, 1, torch.arange(512), torch.arange(512))[0, 0]
    seed, offset = torch.tensor(5), torch.tensor(9)
    k0, k1, ci, cj = dropout.philox4x32((torch.tensor(0), offset, 0, 0), (seed, torch.tensor(0)))
    # Rows 34, 35, 42, 43 and columns 66, 67, 74, 75: units u(34) = 9 and u(66) = 17.
    w = dropout.philox4x32((torch.tensor(9), ci, torch.tensor(17), cj), (k0, k1), rounds=7)
    t = dropout.threshold(p)
    for i in (34, 35, 42, 43):
        for j in (66, 67, 74, 75):
            word = int(w[2 * (i & 1) + (j & 1)])
            byte = (word >> (8 * (2 * ((i >> 3) & 1) + ((j >> 3) & 1)))) & 0xFF
            assert bool(keep[i, j]) == (byte >= t), (i, j)
    for a, b in ((keep[:, :-1], keep[:, 1:]), (keep[:-1], keep[1:]), (keep[:, :-8], keep[:, 8:]),
                 (keep[:-8], keep[8:]), (keep[:, :-16], keep[:, 16:])):  # fmt: skip
        assert abs((a & b).float().mean().item() - (1 - p) ** 2) < 0.01


def test_drop_rate_is_p_in_256ths():
    """p rounds to a multiple of 1 / 256 (at most 255 / 256) and the kept scale undoes exactly that rate."""
    assert [dropout.threshold(p) for p in (0.0, 0.1, 0.25, 0.5, 0.999)] == [0, 26, 64, 128, 255]
    assert dropout.keep_scale(0.25) == 256 / 192
    keep = dropout.keep_mask(3, 4, 0.1, 2, 4, torch.arange(256), torch.arange(256))
    assert abs(keep.float().mean().item() - (1 - 26 / 256)) < 0.004


def test_keep_mask_rate_and_slices():
    rows, cols = torch.arange(300), torch.arange(257)
    keep = dropout.keep_mask(123, 7, 0.3, 2, 3, rows, cols)
    assert keep.shape == (2, 3, 300, 257)
    assert abs(keep.float().mean().item() - 0.7) < 0.01
    # A tile of the mask is the mask of the tile (what lets a kernel compute it per tile).
    tile = dropout.keep_mask(123, 7, 0.3, 1, 3, rows[128:256], cols[64:128], batch_start=1)
    assert torch.equal(tile[0], keep[1, :, 128:256, 64:128])
    assert not torch.equal(keep, dropout.keep_mask(124, 7, 0.3, 2, 3, rows, cols))  # the seed matters
    assert not torch.equal(keep, dropout.keep_mask(123, 8, 0.3, 2, 3, rows, cols))  # and the offset


def dense_dropout(q, k, v, keep, p, causal):
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kk, vv = (t.repeat_interleave(hq // hk, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(d)
    if causal:
        i = torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(torch.arange(sk)[None, :] > i, -math.inf)
    lse = torch.logsumexp(s, -1)
    probs = torch.softmax(s, -1) * keep * dropout.keep_scale(p)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vv), lse


@pytest.mark.parametrize("causal", [False, True])
def test_attn_dropout_is_reproducible_and_exact(causal):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, k, v = mk(2, 150, 4, 16), mk(2, 200, 2, 16), mk(2, 200, 2, 16)
    p = 0.2
    torch.manual_seed(42)
    seed, offset = dropout.draw_seed(torch.device("cpu"))  # what the call will draw
    torch.manual_seed(42)
    out, lse = flash_attn4.attn(q, k, v, causal=causal, dropout_p=p, return_lse=True)
    torch.manual_seed(42)
    again = flash_attn4.attn(q, k, v, causal=causal, dropout_p=p)
    assert torch.equal(out, again)
    assert not torch.equal(out, flash_attn4.attn(q, k, v, causal=causal, dropout_p=p))  # the next draw
    keep = dropout.keep_mask(seed, offset, p, 2, 4, torch.arange(150), torch.arange(200))
    want = dense_dropout(q, k, v, keep, p, causal)
    torch.testing.assert_close((out, lse), want, atol=1e-10, rtol=1e-10)
    go = torch.randn_like(out)
    got = torch.autograd.grad((out * go).sum(), (q, k, v))
    ref = torch.autograd.grad((want[0] * go).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_varlen_dropout_counts_sequences_as_batches():
    lens_q, lens_k = [5, 0, 11], [9, 4, 11]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lens_q), 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lens_k), 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    torch.manual_seed(5)
    seed, offset = dropout.draw_seed(torch.device("cpu"))
    torch.manual_seed(5)
    out = compat.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), 11, 11, 0.25, None, True)
    oq = ok = 0
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq:
            keep = dropout.keep_mask(
                seed, offset, 0.25, 1, 4, torch.arange(lq), torch.arange(lk), batch_start=b
            )
            want, _ = dense_dropout(
                q[None, oq : oq + lq], k[None, ok : ok + lk], v[None, ok : ok + lk], keep, 0.25, True
            )
            torch.testing.assert_close(out[oq : oq + lq], want[0], atol=1e-10, rtol=1e-10)
        oq, ok = oq + lq, ok + lk


def test_a_rate_that_rounds_to_zero_warns():
    q = torch.randn(1, 4, 2, 8)
    with pytest.warns(UserWarning, match="rounds to a drop rate of 0"):
        out = flash_attn4.attn(q, q, q, dropout_p=0.001)
    torch.testing.assert_close(out, flash_attn4.attn(q, q, q))


def test_bad_dropout_is_a_clear_error():
    q = torch.randn(1, 4, 2, 8)
    for p in (1.0, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match="dropout_p"):
            flash_attn4.attn(q, q, q, dropout_p=p)


def test_dropout_compiles_fullgraph_and_matches_eager():
    """The (seed, offset) draw stays on the device, so a call traces whole; same seed, same bits."""
    q, k = torch.randn(1, 130, 2, 16), torch.randn(1, 140, 2, 16)
    fn = torch.compile(lambda q, k: flash_attn4.attn(q, k, k, causal=True, dropout_p=0.3), fullgraph=True,
                       backend="aot_eager")  # fmt: skip
    torch.manual_seed(0)
    compiled = fn(q, k)
    torch.manual_seed(0)
    assert torch.equal(compiled, flash_attn4.attn(q, k, k, causal=True, dropout_p=0.3))


def test_dropout_gradients_through_lse_and_packed_batches():
    """The op's written-out backward (general_bwd_ref with the keep mask) against autograd of dense dropout:
    a loss on out and lse, fixed-length and packed."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, n, 2, 16, generator=g, dtype=torch.float64) for n in (70, 90, 90))
    p = 0.3
    torch.manual_seed(1)
    seed, offset = dropout.draw_seed(torch.device("cpu"))
    keep = dropout.keep_mask(seed, offset, p, 1, 2, torch.arange(70), torch.arange(90))
    go, gl = (
        torch.randn(1, 70, 2, 16, generator=g, dtype=torch.float64),
        torch.randn(1, 2, 70, generator=g, dtype=torch.float64),
    )

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        return torch.autograd.grad((out * go).sum() + (lse * gl).sum(), leaves)

    def ours(*t):
        torch.manual_seed(1)
        return flash_attn4.attn(*t, causal=True, dropout_p=p, return_lse=True)

    for a, b in zip(grads(ours), grads(lambda *t: dense_dropout(*t, keep, p, True))):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)

    def packed(*t):
        torch.manual_seed(1)
        cu_q, cu_k = torch.tensor([0, 70], dtype=torch.int32), torch.tensor([0, 90], dtype=torch.int32)
        out, lse = flash_attn4.attn_varlen(*(x[0] for x in t), cu_q, cu_k, 70, 90, causal=True, dropout_p=p,
                                           return_lse=True)  # fmt: skip
        return out[None], lse[None]

    for a, b in zip(grads(packed), grads(ours)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("packed", [False, True])
def test_dropout_op_opcheck(packed):
    g = torch.Generator().manual_seed(2)
    if packed:
        q, k, v = (torch.randn(n, 2, 16, generator=g, dtype=torch.float64) for n in (40, 50, 50))
        seqs = (torch.tensor([0, 15, 40], dtype=torch.int32), torch.tensor([0, 30, 50], dtype=torch.int32),
                None, None, 25, 30)  # fmt: skip
    else:
        q, k, v = (torch.randn(2, n, 2, 16, generator=g, dtype=torch.float64) for n in (20, 25, 25))
        seqs = (None, None, None, None, 20, 25)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rng = torch.tensor([123456789, 42])
    torch.library.opcheck(torch.ops.flash_attn4.fwd_dropout.default,
                          (*leaves, rng, 0.2, *seqs, 0.25, True, -1, -1, 0.0, False))  # fmt: skip


def test_kernel_bits_match_the_spec(tmp_path):
    """tests/cpp/test_dropout_bits.cpp runs the kernels' dropout code (csrc/common/dropout.hpp) on the host
    through the real sm90 accumulator partitions, every thread of the forward's S (128- and 176-key tiles) and
    the backward's S^T tile at head dim 128, lane pairs trading words as the shuffles do; the masks it prints
    must be keep_mask's bit for bit. Skipped without nvcc / CUTLASS."""
    from host_cpp import run_host_check

    p, (seed, offset), (b, h, heads), (q0, k0) = 0.17, (2**61 + 12345, 77), (1, 2, 3), (256, 384)
    args = [seed, offset, dropout.threshold(p), b, heads, h, q0, k0]
    run = run_host_check("test_dropout_bits", tmp_path, args, sm90=True)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.split()
    masks = dict(zip(lines[0::2], lines[1::2]))
    assert sorted(masks) == ["bwd", "fwd", "fwd176"], run.stdout[:200]
    for name, rows, cols in (("fwd", 128, 128), ("fwd176", 128, 176), ("bwd", 64, 128)):
        bits = masks[name]
        rows_q, cols_k = torch.arange(q0, q0 + rows), torch.arange(k0, k0 + cols)
        keep = dropout.keep_mask(seed, offset, p, 1, heads, rows_q, cols_k, batch_start=b)[0, h]
        want = "".join("1" if x else "0" for x in keep.flatten().tolist())
        assert bits == want, f"{name}: {sum(a != c for a, c in zip(bits, want))} of {len(want)} bits differ"
