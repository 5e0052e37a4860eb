"""attn_varlen (reference path): packed sequences equal each sequence run on its own."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flash_attn4 import attn, attn_varlen
from flash_attn4.reference import attention_varlen_ref


def _cu(lengths: list[int]) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


def _packed(lens_q, lens_k, hq, hk, d, dtype=torch.float64):
    q = torch.randn(sum(lens_q), hq, d, dtype=dtype)
    k = torch.randn(sum(lens_k), hk, d, dtype=dtype)
    v = torch.randn(sum(lens_k), hk, d, dtype=dtype)
    return q, k, v, _cu(lens_q), _cu(lens_k)


CASES = {
    "mixed": ([5, 1, 17, 0, 9], [7, 3, 17, 4, 2]),  # includes empty query / short key sequences
    "total_lt_batch": ([0, 1, 0, 0, 1], [0, 2, 1, 0, 3]),
    "one": ([33], [21]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"causal": True},
        {"window_size": (3, 0)},
        {"window_size": (2, 5)},
        {"softcap": 2.0, "causal": True},
    ],
    ids=["full", "causal", "window_left", "window_both", "softcap"],
)
def test_varlen_equals_per_sequence_attention(case, heads, kw):
    lens_q, lens_k = CASES[case]
    torch.manual_seed(0)
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, *heads, 16)
    out, lse = attn_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0:
            continue
        q0, k0 = int(cu_q[i]), int(cu_k[i])
        want, want_lse = attn(
            q[None, q0 : q0 + nq], k[None, k0 : k0 + nk], v[None, k0 : k0 + nk], return_lse=True, **kw
        )
        torch.testing.assert_close(out[q0 : q0 + nq], want[0])
        torch.testing.assert_close(lse[:, q0 : q0 + nq], want_lse[0])
    assert not out.isnan().any()


def test_rows_that_see_no_key_are_zero_with_neg_inf_lse():
    # Causal with seqlen_q > seqlen_k inside one sequence, and a sequence with no keys at all.
    q, k, v, cu_q, cu_k = _packed([6, 3], [2, 0], 2, 2, 8)
    out, lse = attn_varlen(q, k, v, cu_q, cu_k, 6, 2, causal=True, return_lse=True)
    assert (out[:4] == 0).all() and torch.isneginf(lse[:, :4]).all()
    assert (out[6:] == 0).all() and torch.isneginf(lse[:, 6:]).all()
    assert torch.isfinite(lse[:, 4:6]).all()


def test_seqused_limits_rows_and_keys():
    q, k, v, cu_q, cu_k = _packed([5, 4], [6, 3], 2, 1, 8)
    used_q = torch.tensor([3, 4], dtype=torch.int32)
    used_k = torch.tensor([2, 3], dtype=torch.int32)
    out, lse = attn_varlen(q, k, v, cu_q, cu_k, 5, 6, seqused_q=used_q, seqused_k=used_k, return_lse=True)
    want, want_lse = attn(q[None, :3], k[None, :2], v[None, :2], return_lse=True)
    torch.testing.assert_close(out[:3], want[0])
    torch.testing.assert_close(lse[:, :3], want_lse[0])
    assert (out[3:5] == 0).all() and torch.isneginf(lse[:, 3:5]).all()


def test_varlen_gradcheck():
    q, k, v, cu_q, cu_k = _packed([3, 0, 4], [2, 1, 5], 2, 1, 4)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        out, lse = attn_varlen(q, k, v, cu_q, cu_k, 4, 5, causal=True, return_lse=True)
        return out, torch.where(torch.isinf(lse), 0.0, lse)

    assert torch.autograd.gradcheck(f, inputs)


def test_varlen_gradients_match_per_sequence_autograd():
    lens_q, lens_k = [4, 7], [5, 3]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attn_varlen(*leaves, cu_q, cu_k, 7, 5, causal=True).square().sum().backward()
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        q0, k0 = int(cu_q[i]), int(cu_k[i])
        spans = zip((q, k, v), (q0, k0, k0), (nq, nk, nk))
        sub = [t[None, a : a + n].clone().requires_grad_() for t, a, n in spans]
        attn(*sub, causal=True).square().sum().backward()
        torch.testing.assert_close(leaves[0].grad[q0 : q0 + nq], sub[0].grad[0])
        torch.testing.assert_close(leaves[1].grad[k0 : k0 + nk], sub[1].grad[0])
        torch.testing.assert_close(leaves[2].grad[k0 : k0 + nk], sub[2].grad[0])


def test_varlen_opcheck():
    q, k, v, cu_q, cu_k = _packed([3, 2], [4, 1], 2, 1, 8, dtype=torch.float32)
    args = (q, k, v, cu_q, cu_k, None, None, 3, 4, 1 / math.sqrt(8), True, -1, -1, 0.0, False)
    torch.library.opcheck(torch.ops.flash_attn4.fwd_varlen.default, args)


def test_reference_rejects_bad_offsets():
    q, k, v, _, _ = _packed([3], [3], 1, 1, 4)
    with pytest.raises(ValueError, match="non-decreasing"):
        attention_varlen_ref(q, k, v, torch.tensor([0, 3, 2], dtype=torch.int32), _cu([2, 1]))


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.update(q=a["q"][None]), ValueError, "3-D"),
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError, "int32"),
        (lambda a: a.update(cu_seqlens_k=_cu([1])), ValueError, "same length"),
        (lambda a: a.update(max_seqlen_q=-1), TypeError, "max_seqlen_q"),
        (lambda a: a.update(seqused_q=torch.tensor([1], dtype=torch.int32)), TypeError, "seqused_q"),
        (lambda a: a.update(k=a["k"][:, :, :4], v=a["v"][:, :, :4]), ValueError, "headdim"),
        (lambda a: a.update(q=a["q"][:, :3]), ValueError, "multiple"),
    ],
)
def test_varlen_validation(mutate, exc, match):
    q, k, v, cu_q, cu_k = _packed([2, 3], [2, 3], 4, 2, 8)
    a = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=3)
    mutate(a)
    with pytest.raises(exc, match=match):
        attn_varlen(**a)


def test_varlen_compiles_without_graph_breaks():
    """attn_varlen (forward and backward) traces into one graph: the op never reads offsets on the host."""
    q, k, v, cu_q, cu_k = _packed([3, 5], [4, 2], 2, 1, 8, dtype=torch.float32)

    def loss(q, k, v):
        return attn_varlen(q, k, v, cu_q, cu_k, 5, 4, causal=True, window_size=(2, 0)).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).backward()
    loss(*ref_leaves).backward()
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad)
