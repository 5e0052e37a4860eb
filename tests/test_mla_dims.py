"""A v head dim other than q / k's (DeepSeek-style MLA prefill: 192 / 128): attn and attn_varlen, forward
and gradients, against dense fp64 attention, on the CPU reference (the sm90 forward kernels:
tests/test_mla_kernel.py); and the pick of the MLA kernel that serves a pair of head dims."""

from __future__ import annotations

import math

import pytest
import torch

import flash_attn4


def dense(q, k, v, causal):
    sq, sk = q.shape[1], k.shape[1]
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq), -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.repeat_interleave(g, 2)), torch.logsumexp(
        s, -1
    )


@pytest.mark.parametrize("causal", [False, True])
def test_v_head_dim_differs(causal):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, k, v = mk(2, 37, 4, 24), mk(2, 41, 2, 24), mk(2, 41, 2, 16)
    out, lse = flash_attn4.attn(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (2, 37, 4, 16)
    want = dense(q, k, v, causal)
    torch.testing.assert_close((out, lse), want, atol=1e-10, rtol=1e-10)
    go = torch.randn_like(out)
    for a, b in zip(
        torch.autograd.grad((out * go).sum(), (q, k, v)), torch.autograd.grad((want[0] * go).sum(), (q, k, v))
    ):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_varlen_v_head_dim_differs():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(30, 4, 24, generator=g, dtype=torch.float64)
    k = torch.randn(25, 2, 24, generator=g, dtype=torch.float64)
    v = torch.randn(25, 2, 16, generator=g, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, 12, 30], dtype=torch.int32), torch.tensor([0, 10, 25], dtype=torch.int32)
    out = flash_attn4.attn_varlen(q, k, v, cu_q, cu_k, 18, 15, causal=True)
    assert out.shape == (30, 4, 16)
    for (q0, q1), (k0, k1) in (((0, 12), (0, 10)), ((12, 30), (10, 25))):
        want, _ = dense(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], True)
        # Rows that see no key (causal, more queries than keys) are 0 here and NaN in the dense softmax.
        torch.testing.assert_close(out[q0:q1], want[0].nan_to_num(0.0), atol=1e-10, rtol=1e-10)


def test_mla_head_dims_pick_the_kernel_that_pads_them(monkeypatch):
    """_build_info.mla_hdims: the MLA kernel whose q / k head dim is the padded one and whose v head dim is at
    least v's (and below q / k's); None for equal head dims or when no MLA kernel was built."""
    from flash_attn4 import _build_info

    monkeypatch.setattr(_build_info, "HDIMS", (64, 128, 192, 256))
    monkeypatch.setattr(_build_info, "MLA_HDIMS", ((192, 128),))
    assert _build_info.mla_hdims(192, 128) == (192, 128)
    assert _build_info.mla_hdims(184, 120) == (192, 128)  # both zero-padded
    assert _build_info.mla_hdims(192, 136) is None  # v wider than the kernel's
    assert _build_info.mla_hdims(128, 64) is None  # q / k 128: no MLA kernel
    assert _build_info.mla_hdims(192, 192) is None and _build_info.mla_hdims(192, 100) is None  # 100 % 8
    monkeypatch.setattr(_build_info, "MLA_HDIMS", ())
    assert _build_info.mla_hdims(192, 128) is None


def test_mla_kernel_layouts(tmp_path):
    """tests/cpp/test_mla_layouts.cpp walks the MLA traits' real CuTe layouts and partitions on the host:
    the accumulators of O, dV and dK cover their tiles once, O written over Q's buffer stays on its own
    warpgroup's rows, dO^T's view is dO's bytes, and the transaction byte counts match the tiles. Skipped
    without nvcc / CUTLASS."""
    from host_cpp import run_host_check

    run = run_host_check("test_mla_layouts", tmp_path, sm90=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
