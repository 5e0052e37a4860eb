"""Attention sinks (GPT-OSS's per-head logits in every softmax denominator): argument checks and the merge
that applies them after the attention kernels (docs/design.md, "Attention sinks")."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _validate_sinks(sinks: Any, nheads_q: int, device: torch.device) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, Tensor) or sinks.dim() != 1 or sinks.numel() != nheads_q:
        raise ValueError(
            f"sinks must be a 1-D tensor of one logit per query head ({nheads_q}), got "
            f"{tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__}"
        )
    if not sinks.is_floating_point() or sinks.device != device:
        raise TypeError(f"sinks must be a floating-point tensor on q's device {device}, got {sinks.dtype} "
                        f"on {sinks.device}")  # fmt: skip


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """Adds each query head's sink logit to every row's softmax denominator, after the fact: the attention
    over the keys merged with an empty partial whose lse is the sink (merge_attn_states' math), so
    out' = out * sigmoid(lse - sink) and lse' = logaddexp(lse, sink). Differentiable in out, lse and sinks
    (the kernels' backward takes the gradient of lse); a row that sees no key keeps out = 0 and gets
    lse = sink. `head_dim` is lse's head dimension (out's is the one before its last)."""
    return _SinkMerge.apply(out, lse, sinks, head_dim)


def _scaled_rows(x: Tensor, w: Tensor) -> Tensor:
    """x * w in x's dtype in one pass (the product in fp32, rounded once on the store): a bf16 x times an
    fp32 w otherwise makes an fp32 tensor and a second pass to cast it back."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return (x * w).to(x.dtype)
    return torch.mul(x, w, out=torch.empty_like(x))


class _SinkMerge(torch.autograd.Function):
    """_with_sinks with its backward written out, so that each direction passes over out-sized tensors as few
    times as it must: forward out * w (one pass); backward dout * w and rowsum(dout * out), with
    w = sigmoid(lse - sink). Gradients: d out = dout' w; with dw = rowsum(dout' out), d lse = dw w (1 - w) +
    dlse' w and d sink = sum over rows of (dlse' (1 - w) - dw w (1 - w))."""

    @staticmethod
    def forward(ctx, out, lse, sinks, head_dim):
        new_out, new_lse, w = merge(out, lse, sinks, head_dim)
        ctx.save_for_backward(out, w)
        ctx.head_dim, ctx.sink_dtype = head_dim, sinks.dtype
        ctx.set_materialize_grads(False)
        return new_out, new_lse

    @staticmethod
    def backward(ctx, dout, dlse):
        out, w = ctx.saved_tensors
        hd = ctx.head_dim
        g = w * (1 - w)
        d_w = None
        if dout is not None:
            # rowsum(dout * out), summed in lse's precision (fp32 for bf16 / fp16 inputs).
            d_w = (dout * out).sum(dim=-1, dtype=w.dtype).movedim(-1, hd)
        d_lse = torch.zeros_like(w) if d_w is None else d_w * g
        d_sink_rows = torch.zeros_like(w) if d_w is None else -d_w * g
        if dlse is not None:
            d_lse = d_lse + dlse * w
            d_sink_rows = d_sink_rows + dlse * (1 - w)
        dims = [i for i in range(w.dim()) if i != hd]
        d_sinks = d_sink_rows.sum(dim=dims).to(ctx.sink_dtype)
        d_out = None if dout is None else _scaled_rows(dout, _rows_of(w, hd))
        return d_out, d_lse, d_sinks, None


def merge(out: Tensor, lse: Tensor, sinks: Tensor, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """(out * w, logaddexp(lse, sink), w) with w = sigmoid(lse - sink) in lse's layout; no autograd."""
    shape = [1] * lse.dim()
    shape[head_dim] = -1
    sink = sinks.to(lse.dtype).view(shape)
    w = torch.sigmoid(lse - sink)
    return _scaled_rows(out, _rows_of(w, head_dim)), torch.logaddexp(lse, sink), w


def sinks_grad(dout: Tensor | None, dlse: Tensor | None, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d sinks of attention whose out (b, s, h, d) and lse (b, h, s) already include the sinks:
    -sum over rows of exp(sink - lse) (D - dlse), D = rowsum(dout * out) (an extra logit's softmax weight)."""
    g = torch.zeros_like(lse) if dout is None else (dout * out).sum(dim=-1, dtype=lse.dtype).transpose(1, 2)
    if dlse is not None:
        g = g - dlse
    return sinks_grad_from(g, lse, sinks)


def sinks_grad_from(g: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d sinks from g = D - dlse (b, h, s), any strides, and the sinked lse (b, h, s)."""
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    return -(p_sink * g).sum(dim=(0, 2)).to(sinks.dtype)


def _rows_of(w: Tensor, head_dim: int) -> Tensor:
    """lse-layout weights (..., heads, rows) or (heads, rows) -> out's layout (..., rows, heads, 1)."""
    return w.movedim(head_dim, -1).unsqueeze(-1)
