"""The sm90 backward kernel, through the public API (autograd on flash_attn4.attn), against the reference.

Tolerance, as for the forward (FlashAttention's rule): with `truth` the fp32 reference gradient and
`torch_lp` the gradient of the same reference run in the input dtype (autograd through
attention_ref(upcast=False)),

    max|ours - truth| <= 2 * max|torch_lp - truth| + floor,

floor = max|round_to_dtype(truth) - truth| + 1e-4, for dq, dk and dv. Gradients are taken with
torch.autograd.grad into fresh tensors; a NaN anywhere fails. Also: deterministic=True gives bitwise
identical gradients over 10 runs at every backward head dim, gradients through lse, fully masked rows,
opcheck of the CUDA ops and a torch.compile(fullgraph=True) training step.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_attn4 import _build_info, attn
from flash_attn4.reference import attention_bwd_ref, attention_ref

DEVICE = torch.device("cuda")
# Head dims with a compiled backward for this GPU's kernel family, or the usual ones for the skip message.
BWD_HDIMS = list(_build_info.HDIMS) or [64, 96, 128]
ONE_HDIM = 128 if 128 in BWD_HDIMS else BWD_HDIMS[-1]  # for the tests that run one head dim
DTYPES = [{"bf16": torch.bfloat16, "fp16": torch.float16}[n] for n in _build_info.DTYPES] or [
    torch.bfloat16,
    torch.float16,
]


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    ext, why = _build_info.load_extension()
    if ext is None:
        return why
    if not hasattr(ext, "bwd"):
        return "this build of flash_attn4._C has no backward kernels"
    ok, why = _build_info.kernel_available(DEVICE, DTYPES[0], BWD_HDIMS[0])
    return None if ok else why


_SKIP = _skip_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_SKIP is not None, reason=f"flash_attn4 CUDA backward unavailable: {_SKIP}"),
]


def _max_err(a, b):
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _kernel_grads(q, k, v, dout, causal, scale, deterministic=False):
    qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attn(qa, ka, va, causal=causal, softmax_scale=scale, deterministic=deterministic)
    return torch.autograd.grad(out, (qa, ka, va), dout)


def _lp_grads(q, k, v, dout, causal, scale):
    qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, _ = attention_ref(qa, ka, va, causal=causal, softmax_scale=scale, upcast=False)
    out.backward(dout)
    return qa.grad, ka.grad, va.grad


def assert_grads_close(q, k, v, dout, causal, scale, what=""):
    ours = _kernel_grads(q, k, v, dout, causal, scale)
    q32, k32, v32, dout32 = (t.float() for t in (q, k, v, dout))
    truth = attention_bwd_ref(dout32, q32, k32, v32, causal=causal, softmax_scale=scale)
    lp = _lp_grads(q, k, v, dout, causal, scale)
    for name, g, t, g_lp in zip(("dq", "dk", "dv"), ours, truth, lp):
        assert not g.isnan().any(), f"{what}: {name} has NaN (unwritten or bad) elements"
        floor = _max_err(t.to(g.dtype), t) + 1e-4
        err, err_lp = _max_err(g, t), _max_err(g_lp, t)
        assert err <= 2 * err_lp + floor, f"{what}: {name} error {err:.3g} > 2 * {err_lp:.3g} + {floor:.3g}"


SEQLENS = [(1, 1), (17, 113), (113, 203), (128, 128), (239, 17), (300, 1), (1023, 1024)]


@pytest.mark.parametrize("seqlens", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", BWD_HDIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_bwd_matches_reference(dtype, hdim, causal, heads, seqlens):
    sq, sk = seqlens
    hq, hk = heads
    torch.manual_seed(sq * 1000 + sk)
    q = torch.randn(2, sq, hq, hdim, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(2, sk, hk, hdim, dtype=dtype, device=DEVICE) for _ in range(2))
    dout = torch.randn_like(q)
    what = f"{dtype} d{hdim} causal={causal} heads={heads} seqlens={seqlens}"
    assert_grads_close(q, k, v, dout, causal, 1 / math.sqrt(hdim), what)


def test_fully_masked_rows_have_zero_finite_gradients():
    # causal with seqlen_q > seqlen_k: the first rows see no key.
    dtype, d = DTYPES[0], ONE_HDIM
    q = torch.randn(1, 200, 2, d, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(1, 50, 2, d, dtype=dtype, device=DEVICE) for _ in range(2))
    dq, dk, dv = _kernel_grads(q, k, v, torch.randn_like(q), True, 1 / math.sqrt(d))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert (dq[:, :150] == 0).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", BWD_HDIMS)
def test_deterministic_backward_is_bitwise_reproducible(hdim, causal):
    torch.manual_seed(hdim)
    q = torch.randn(2, 700, 4, hdim, dtype=DTYPES[0], device=DEVICE)
    k, v = (torch.randn(2, 900, 2, hdim, dtype=DTYPES[0], device=DEVICE) for _ in range(2))
    dout = torch.randn_like(q)
    first = _kernel_grads(q, k, v, dout, causal, hdim**-0.5, deterministic=True)
    for _ in range(9):
        again = _kernel_grads(q, k, v, dout, causal, hdim**-0.5, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    # and it is the same gradient as the default mode's, up to summation order
    assert_grads_close(q, k, v, dout, causal, hdim**-0.5, "deterministic")


def test_gradient_through_lse():
    dtype, d = DTYPES[0], ONE_HDIM
    torch.manual_seed(1)
    q = torch.randn(2, 150, 4, d, dtype=dtype, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(2, 190, 2, d, dtype=dtype, device=DEVICE, requires_grad=True) for _ in range(2))
    out, lse = attn(q, k, v, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    truth = attention_bwd_ref(dout.float(), q32, k32, v32, dlse=dlse, causal=True)
    for name, g, t in zip(("dq", "dk", "dv"), grads, truth):
        err = _max_err(g, t)
        assert err <= 0.05 * t.abs().max().item() + 1e-3, f"{name}: error {err:.3g}"


def test_opcheck_cuda_ops():
    torch.manual_seed(2)
    dtype, d = DTYPES[0], BWD_HDIMS[0]
    q = torch.randn(2, 77, 4, d, dtype=dtype, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(2, 91, 2, d, dtype=dtype, device=DEVICE, requires_grad=True) for _ in range(2))
    args = (d**-0.5, True, -1, 0, 0.0, True)  # deterministic: opcheck compares repeated runs bitwise
    torch.library.opcheck(torch.ops.flash_attn4.fwd.default, (q, k, v, *args))
    out, lse = torch.ops.flash_attn4.fwd(q.detach(), k.detach(), v.detach(), *args)
    bwd_args = (torch.randn_like(out), None, q.detach(), k.detach(), v.detach(), out, lse, *args)
    torch.library.opcheck(torch.ops.flash_attn4.bwd.default, bwd_args)


def test_gradients_of_transposed_inputs_keep_their_layout():
    # HuggingFace passes (batch, heads, seqlen, d) tensors transposed: the kernels write dq/dk/dv in that
    # layout (so nothing downstream copies them) and the values match the contiguous run bitwise.
    torch.manual_seed(4)
    dtype, d = DTYPES[0], BWD_HDIMS[0]
    q = torch.randn(2, 4, 200, d, dtype=dtype, device=DEVICE).transpose(1, 2)
    k, v = (torch.randn(2, 2, 173, d, dtype=dtype, device=DEVICE).transpose(1, 2) for _ in range(2))
    args = (d**-0.5, True, -1, 0, 0.0, True)
    out, lse = torch.ops.flash_attn4.fwd(q, k, v, *args)
    dout = torch.randn_like(out)
    grads = torch.ops.flash_attn4.bwd(dout, None, q, k, v, out, lse, *args)
    plain = torch.ops.flash_attn4.bwd(
        dout, None, q.contiguous(), k.contiguous(), v.contiguous(), out, lse, *args
    )
    for g, p, t in zip(grads, plain, (q, k, v)):
        assert g.stride() == t.stride()
        assert torch.equal(g, p)
    torch.library.opcheck(torch.ops.flash_attn4.bwd.default, (dout, None, q, k, v, out, lse, *args))


def test_compiled_training_step_matches_eager():
    # fullgraph: the forward and loss trace into one graph (fake impls), AOTAutograd builds the backward
    # graph through the registered autograd formula, so loss.backward() runs the bwd op compiled too.
    torch.manual_seed(3)
    dtype, d = DTYPES[0], ONE_HDIM
    proj = torch.nn.Linear(d, d, device=DEVICE, dtype=dtype)
    x = torch.randn(2, 256, 4, d, dtype=dtype, device=DEVICE)

    def loss_fn(x):
        out = attn(proj(x), x, x, causal=True, deterministic=True)
        return out.float().square().mean()

    eager_loss = loss_fn(x)
    eager_loss.backward()
    eager_grad = proj.weight.grad.clone()
    proj.weight.grad = None
    compiled_loss = torch.compile(loss_fn, fullgraph=True)(x)
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(proj.weight.grad, eager_grad, atol=1e-2, rtol=1e-2)


def test_cuda_graph_capture_of_forward_and_backward():
    # The ops allocate through the caching allocator and never synchronize with the host, so one training
    # step of attention can be captured and replayed on new inputs.
    torch.manual_seed(4)
    dtype, d = DTYPES[0], ONE_HDIM
    q, dout = (torch.randn(2, 300, 4, d, dtype=dtype, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(2, 300, 2, d, dtype=dtype, device=DEVICE) for _ in range(2))
    static = [t.clone().requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]

    def step():
        out = attn(*static[:3], causal=True)
        return (out, *torch.autograd.grad(out, static[:3], static[3]))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up outside the graph (lazy init, allocator pools)
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        fresh = [torch.randn_like(t) for t in static]
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
        graph.replay()
        eager = step()
        for name, a, b in zip(("out", "dq", "dk", "dv"), captured, eager):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("hdim", sorted({BWD_HDIMS[0], BWD_HDIMS[-1]}))
def test_deterministic_causal_long_sequence_finishes(hdim):
    """More key blocks per (batch, head) than CTAs that fit on the GPU at once: with deterministic=True the
    causal dQ order (last key block first) must not leave resident CTAs waiting for unlaunched ones."""
    dtype = DTYPES[0]
    s = 20480  # 160 key blocks of 128 (320 of 64): more than the 132 SMs hold
    q, k, v = (torch.randn(1, s, 1, hdim, dtype=dtype, device=DEVICE) for _ in range(3))
    dout = torch.randn_like(q)
    first = _kernel_grads(q, k, v, dout, True, hdim**-0.5, deterministic=True)
    torch.cuda.synchronize()
    second = _kernel_grads(q, k, v, dout, True, hdim**-0.5, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
