"""Tiles chosen from the device's shared memory (csrc/common/tile_size.h): FLASH_ATTN4_SMEM_CAP makes the
Ampere-path kernels take the tiles a 99 KB card (sm86 / 89 / 120) gets, so one GPU tests them.

CPU: how the cap is read. GPU (where the Ampere-path kernels are built; FLASH_ATTN4_FORCE_SM80 on Hopper):
forward and backward at every built head dim under the 99 KB cap against the fp64 reference (the GPU tests'
rule: error <= 2 x the error of the same math in the input dtype + a rounding floor), windows, softcap and
packed batches; decoding at a head dim whose decode kernel does not fit; and a cap below every tile is a
clear error, not a fault. The whole GPU suite also runs under the cap: `FLASH_ATTN4_SMEM_CAP=101376
FLASH_ATTN4_FORCE_SM80=1 pytest tests` (README, "Consumer GPUs").
"""

from __future__ import annotations

import pytest
import torch

from flash_attn4 import _build_info, attn, attn_varlen
from flash_attn4.reference import attention_ref

CAP_99KB = "101376"


def test_cap_lowers_the_device_limit_and_is_checked(monkeypatch):
    monkeypatch.setattr(_build_info, "_smem_optin", lambda index: 232448)
    device = torch.device("cuda", 0)
    monkeypatch.delenv("FLASH_ATTN4_SMEM_CAP", raising=False)
    assert _build_info.smem_per_block(device) == 232448
    monkeypatch.setenv("FLASH_ATTN4_SMEM_CAP", CAP_99KB)
    assert _build_info.smem_per_block(device) == 101376
    assert _build_info.decode_fits(device, 128) and not _build_info.decode_fits(device, 256)
    monkeypatch.setenv("FLASH_ATTN4_SMEM_CAP", "300000")  # a cap above the device changes nothing
    assert _build_info.smem_per_block(device) == 232448
    monkeypatch.setenv("FLASH_ATTN4_SMEM_CAP", "99KB")
    with pytest.raises(ValueError, match="FLASH_ATTN4_SMEM_CAP must be a positive number of bytes"):
        _build_info.smem_per_block(device)


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if "sm80" not in _build_info.ARCHS:
        return "the Ampere-path kernels are not built (FLASH_ATTN4_ARCHS with 80, or FLASH_ATTN4_FAMILIES=80)"
    major, _ = torch.cuda.get_device_capability()
    if major == 9 and not _build_info.force_sm80() and "sm90" in _build_info.ARCHS:
        return "Hopper runs the sm90 kernels; FLASH_ATTN4_FORCE_SM80=1 tests the Ampere path"
    return None


_SKIP = _skip_reason()
gpu = pytest.mark.skipif(_SKIP is not None, reason=f"{_SKIP}")


@pytest.fixture
def cap_99kb(monkeypatch):
    monkeypatch.setenv("FLASH_ATTN4_SMEM_CAP", CAP_99KB)


def _check(ours, truth, lp, names):
    for name, o, t, low in zip(names, ours, truth, lp):
        assert torch.isfinite(o).all(), name
        floor = (t.to(o.dtype).double() - t).abs().max().item() + 1e-4
        err, err_lp = (o.double() - t).abs().max().item(), (low.double() - t).abs().max().item()
        assert err <= 2 * err_lp + floor, f"{name}: {err:.3g} > 2 * {err_lp:.3g} + {floor:.3g}"


def _run(fn, leaves, dtype, g_out):
    leaves = [t.to(dtype).requires_grad_() for t in leaves]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, g_out.to(out.dtype))
    return [out, *grads]


def _check_with_grads(ours_fn, ref, leaves, g_out):
    """ours_fn in bf16 against ref(..., upcast=True) in fp64, with ref(..., upcast=False) in bf16 as the
    same math's error: out, dq, dk, dv."""
    ours = _run(ours_fn, leaves, torch.bfloat16, g_out)
    truth = _run(ref, leaves, torch.float64, g_out)
    lp = _run(lambda q, k, v: ref(q, k, v, upcast=False), leaves, torch.bfloat16, g_out)
    _check(ours, truth, lp, ("out", "dq", "dk", "dv"))


@pytest.mark.parametrize("hdim", list(_build_info.HDIMS) or [128])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "softcap"])
@pytest.mark.gpu
@gpu
def test_99kb_tiles_match_the_reference(cap_99kb, hdim, mask):
    g = torch.Generator(device="cuda").manual_seed(hdim)
    b, sq, sk, hq, hk = 2, 301, 517, 4, 2
    q, k, v = (
        torch.randn(b, n, h, hdim, device="cuda", generator=g) for n, h in ((sq, hq), (sk, hk), (sk, hk))
    )
    g_out = torch.randn(b, sq, hq, hdim, device="cuda", generator=g)
    kw = {
        "none": {},
        "causal": {"causal": True},
        "window": {"window_size": (100, 37)},
        "softcap": {"softcap": 5.0, "causal": True},
    }[mask]
    ref_kw = {"causal": kw.get("causal", False), "window_size": kw.get("window_size", (-1, -1))}
    ref_kw["softcap"] = kw.get("softcap", 0.0)

    def ref(q, k, v, upcast=True):
        return attention_ref(q, k, v, upcast=upcast, **ref_kw)[0]

    _check_with_grads(lambda q, k, v: attn(q, k, v, **kw), ref, (q, k, v), g_out)


@pytest.mark.gpu
@gpu
def test_99kb_tiles_packed_batches(cap_99kb):
    hdim = max(_build_info.HDIMS)  # the head dim whose tiles change the most under the cap
    g = torch.Generator(device="cuda").manual_seed(1)
    lens = [130, 7, 301]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    total, hq = sum(lens), 4
    q, k, v = (torch.randn(total, hq, hdim, device="cuda", generator=g) for _ in range(3))
    g_out = torch.randn(total, hq, hdim, device="cuda", generator=g)

    def ours_fn(q, k, v):
        return attn_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)

    def ref(q, k, v, upcast=True):
        outs = [
            attention_ref(q[None, a:e], k[None, a:e], v[None, a:e], causal=True, upcast=upcast)[0][0]
            for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())
        ]
        return torch.cat(outs)

    _check_with_grads(ours_fn, ref, (q, k, v), g_out)


@pytest.mark.gpu
@gpu
def test_decoding_where_the_decode_kernel_does_not_fit(cap_99kb):
    """Query length 1 where the decode kernel needs more than 99 KB: the forward kernels serve it."""
    hdim = max(_build_info.HDIMS)
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(3, 1, 8, hdim, device="cuda", generator=g)
    k, v = (torch.randn(3, 1000, 2, hdim, device="cuda", generator=g) for _ in range(2))
    ours = attn(*(t.bfloat16() for t in (q, k, v)), causal=True)
    truth = attention_ref(q.double(), k.double(), v.double(), causal=True)[0]
    lp = attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, upcast=False)[0]
    _check([ours], [truth], [lp], ("out",))


@pytest.mark.gpu
@gpu
def test_a_cap_below_every_tile_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("FLASH_ATTN4_SMEM_CAP", "40000")
    hdim = max(_build_info.HDIMS)
    q, k, v = (torch.randn(1, 256, 2, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(RuntimeError, match="bytes of shared memory a block"):
        attn(q, k, v)
    monkeypatch.delenv("FLASH_ATTN4_SMEM_CAP")
    torch.cuda.synchronize()  # the context is intact: nothing was launched
    assert torch.isfinite(attn(q, k, v)).all()
