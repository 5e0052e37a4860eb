"""torch.library custom ops: the one autograd path.

    flash_attn4::fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic)
        -> (out, lse)
    flash_attn4::bwd(dout, dlse?, q, k, v, out, lse, softmax_scale, causal, window_left, window_right,
                     softcap, deterministic) -> (dq, dk, dv)
    flash_attn4::fwd_varlen / bwd_varlen (_ops_varlen.py): the same for packed batches (cu_seqlens, seqused)

Both have fake (meta) implementations, so torch.compile(fullgraph=True) and CUDA-graph capture trace
through them. Each call goes to the compiled kernel when one can serve it (see `_kernel_plan`), else to
`reference.attention_ref`; a CUDA call that falls back warns once per reason.

No `from __future__ import annotations` here: custom_op reads the schema from real annotations.
"""

import warnings
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from flash_attn4 import _build_info, reference


class ReferenceFallbackWarning(UserWarning):
    """A CUDA call ran on the slow PyTorch reference; the message says why and how to fix it."""


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"flash_attn4: using the slow PyTorch reference on CUDA: {reason}",
            ReferenceFallbackWarning,
            stacklevel=3,
        )


def _effective_mask(
    seqlen_q: int, seqlen_k: int, causal: bool, window_left: int, window_right: int
) -> tuple[int, int]:
    """(left, right) after dropping window sides that mask nothing; -1 = unbounded.

    With query i at key position p = i + seqlen_k - seqlen_q (p in [seqlen_k - seqlen_q, seqlen_k - 1]):
    left >= seqlen_k - 1 never excludes a key j >= 0, right >= seqlen_q - 1 never excludes j <= seqlen_k - 1.
    """
    right = (0 if window_right < 0 else min(window_right, 0)) if causal else window_right
    left = -1 if window_left < 0 or window_left >= seqlen_k - 1 else window_left
    right = -1 if right < 0 or right >= seqlen_q - 1 else right
    return left, right


class _Plan(NamedTuple):
    """What the kernel is asked to do: the kernel family, and `causal` alone or a window (left/right, -1 =
    unbounded; never both: the binding's contract)."""

    arch: int
    causal: bool
    window_left: int = -1
    window_right: int = -1


def _kernel_plan(
    q: Tensor,
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    window_left: int,
    window_right: int,
    head_dim_v: Optional[int] = None,
    mla: bool = False,
) -> tuple[Optional[_Plan], str]:
    """The one place that picks the path of a call (dense or packed; for packed batches seqlen_q/k are the
    max_seqlen bounds): (plan, "") for the kernels, or (None, why the reference runs; "" when there is nothing
    to compute). Softcap and packed batches need nothing more than the kernel family, which every build has
    for every mask. A v head dim other than q / k's (MLA) has sm90 kernels of its own: `mla` says the caller
    is a plain forward or backward (dense or packed; no bias, dropout, sinks, block mask) that takes them."""
    if q.numel() == 0 or seqlen_q == 0 or seqlen_k == 0:
        return None, ""  # nothing to compute (or only empty rows): no kernel launch, nothing to warn about
    arch, why = _build_info.kernel_available(q.device, q.dtype, q.shape[-1])
    if arch is None:
        return None, why
    if head_dim_v is not None and head_dim_v != q.shape[-1]:
        dims = _build_info.mla_hdims(q.shape[-1], head_dim_v)
        if not (mla and arch == 90 and dims is not None):
            what = "this call" if mla else "ALiBi, dropout, sinks or a block mask"
            return None, (
                f"no CUDA kernel takes {what} with a v head dim ({head_dim_v}) other than q / k's "
                f"({q.shape[-1]}): the MLA kernels are plain sm90 ones of (q / k, v) head dims "
                f"{_build_info.MLA_HDIMS or '(none built)'}; the PyTorch reference runs"
            )
    return _Plan(arch, *_mask_kind(seqlen_q, seqlen_k, causal, window_left, window_right)), ""


def _mask_kind(
    seqlen_q: int, seqlen_k: int, causal: bool, window_left: int, window_right: int
) -> tuple[bool, int, int]:
    """(causal, left, right) as the kernels take them: the causal kernel alone, or a window (-1 = unbounded
    side), never both; (False, -1, -1) when nothing is masked."""
    left, right = _effective_mask(seqlen_q, seqlen_k, causal, window_left, window_right)
    if left == -1 and right in (-1, 0):
        return right == 0, -1, -1
    return False, left, right


def _tma_ready(t: Tensor) -> Tensor:
    """`t` itself when the kernel can read it in place, else a contiguous copy.

    TMA needs a last-dim stride of 1, every other stride a multiple of 8 elements (16 bytes) and a
    16-byte aligned base. A stride of 0 on a dim of size > 1 (an expanded tensor) is copied too: a TMA
    descriptor is not meant to describe overlapping rows. `clone`, not `contiguous`: the latter returns a
    misaligned or odd-strided size-1 tensor unchanged because it already counts as contiguous.
    """
    if _tma_strides_ok(t) and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _tma_strides_ok(t: Tensor) -> bool:
    """Last-dim stride 1, the others multiples of 8 elements and not 0 on a dim of size > 1."""
    return t.stride(-1) == 1 and all(
        s % 8 == 0 and (s != 0 or n == 1) for s, n in zip(t.stride()[:-1], t.shape[:-1])
    )


def _grad_like(t: Tensor) -> Tensor:
    """An empty gradient buffer for input `t`: `t`'s own strides where the kernels can write them, else
    contiguous.

    A model hands over (batch, heads, seqlen, d) tensors transposed to (batch, seqlen, heads, d); their
    gradients then come back in the model's layout and whatever runs next (RoPE's backward, AccumulateGrad)
    reads them without a copy or a strided kernel. Depends only on shape and strides, so the fake kernels
    use it too (compiled graphs see the real strides).
    """
    g = torch.empty_like(t)  # preserve_format: t's strides when t is dense and non-overlapping
    return g if _tma_strides_ok(g) else torch.empty_like(t, memory_format=torch.contiguous_format)


def _in_grad_layout(g: Tensor, like: Tensor) -> Tensor:
    """`g` with the strides `_grad_like(like)` gives (the reference path's results, for the fake's sake)."""
    target = _grad_like(like)
    if target.stride() == g.stride():
        return g
    return target.copy_(g)


def _kernel_options(plan: _Plan, softcap: float, varlen: Optional[dict]) -> dict:
    """Keyword arguments of `_C.fwd` / `_C.bwd` beyond the tensors, scale and causal flag."""
    kw = {
        "window_left": int(plan.window_left),
        "window_right": int(plan.window_right),
        "softcap": float(softcap),
        "kernel_arch": int(plan.arch),
    }
    return {**kw, **(varlen or {})}


def _alibi_arg(slopes: Optional[Tensor]) -> dict:
    """`_C.fwd` / `_C.bwd`'s alibi_slopes argument: fp32 with a contiguous last dim (a copy otherwise)."""
    if slopes is None:
        return {}
    return {"alibi_slopes": slopes.to(torch.float32).contiguous()}


def _dropout_arg(dropout: Optional[tuple[float, Tensor]]) -> dict:
    if dropout is None or dropout[0] == 0:
        return {}
    return {"dropout_p": float(dropout[0]), "dropout_rng": dropout[1].contiguous()}


def _kernel_dims(d: int, dv: int) -> tuple[int, int]:
    """The (q / k, v) head dims of the built kernel that serves head dims (d, dv), each padded up with zero
    columns: padded_hdim's for one head dim, the MLA pair's (_build_info.mla_hdims) for two."""
    dims = _build_info.mla_hdims(d, dv) if dv != d else (_build_info.padded_hdim(d),) * 2
    if dims is None or dims[0] is None:
        raise ValueError(f"head dims {d} / {dv} have no built kernel (built: {_build_info.HDIMS}, MLA "
                         f"{_build_info.MLA_HDIMS})")  # fmt: skip
    return dims


def fwd_into(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    softmax_scale: float,
    plan: _Plan,
    *,
    softcap: float = 0.0,
    varlen: Optional[dict] = None,
    blocks: Optional[dict] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout: Optional[tuple[float, Tensor]] = None,
) -> None:
    """Run the compiled forward kernel, writing `out` and `lse`.

    Args:
        q: (batch, seqlen_q, nheads_q, headdim) fp16/bf16 on an sm90 device; k, v: (batch, seqlen_k,
            nheads_kv, headdim), same dtype (v: a smaller head dim where an MLA kernel takes it,
            _build_info.mla_hdims). Packed batches (`varlen` given): (total, heads, headdim). Any strides;
            copies are made only where TMA needs them.
        out: shaped like q with v's head dim, q's dtype, contiguous. Written (packed: rows of the sequences
            only).
        lse: (batch, nheads_q, seqlen_q), packed (nheads_q, total_q), float32, contiguous. Written.
        softmax_scale: for the ORIGINAL head dim (padding below must not change it).
        plan: from `_kernel_plan` (kernel family and mask).
        varlen: cu_seqlens_q/k, seqused_q/k, max_seqlen_q/k for `_C.fwd`.
        blocks: a block mask's lists (block_kv_count, ...) for `_C.fwd`'s block-sparse kernels.
        alibi_slopes: fp32 (nheads_q,) or (batch, nheads_q) for the ALiBi kernels (no softcap).
        sinks: (nheads_q,) logits the sm90 kernels fold into out and lse (apply_sink).
        dropout: (dropout_p, rng) for the dropout kernels, rng the call's int64 (2,) (seed, offset) on q's
            device (flash_attn4.dropout.draw_rng_state).
    """
    ext, why = _build_info.load_extension()
    if ext is None:
        raise RuntimeError(why)
    d, dv = q.shape[-1], v.shape[-1]
    out_shape = (*q.shape[:-1], dv)
    if out.shape != out_shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {out_shape}")
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    if lse.shape != lse_shape or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"lse must be a contiguous float32 tensor of shape {lse_shape}")
    dpad, dvpad = _kernel_dims(d, dv)
    # Zero columns add nothing to q.k, and zero v columns produce zero output columns, which are dropped.
    if dpad != d:
        q, k = (torch.nn.functional.pad(t, (0, dpad - d)) for t in (q, k))
    if dvpad != dv:
        v = torch.nn.functional.pad(v, (0, dvpad - dv))
        out_k = torch.nn.functional.pad(out, (0, dvpad - dv))  # keeps out's values in rows not written
    else:
        out_k = out
    ext.fwd(
        _tma_ready(q),
        _tma_ready(k),
        _tma_ready(v),
        out_k,
        lse,
        float(softmax_scale),
        bool(plan.causal),
        **_kernel_options(plan, softcap, varlen),
        **(blocks or {}),
        **_alibi_arg(alibi_slopes),
        **({} if sinks is None else {"sinks": sinks.to(torch.float32).contiguous()}),
        **_dropout_arg(dropout),
    )
    if out_k is not out:
        out.copy_(out_k[..., :dv])


def bwd_into(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    softmax_scale: float,
    plan: _Plan,
    deterministic: bool = False,
    dlse: Optional[Tensor] = None,
    *,
    softcap: float = 0.0,
    varlen: Optional[dict] = None,
    blocks: Optional[dict] = None,
    alibi_slopes: Optional[Tensor] = None,
    dropout: Optional[tuple[float, Tensor]] = None,
) -> Tensor:
    """Run the compiled backward kernel, writing dq, dk and dv. Returns the kernel's D - dlse (D = rowsum(dout
    * out)), float32: fixed-length (batch * nheads_q, rows) with rows >= seqlen_q (the first seqlen_q are the
    sequence's), packed batches (nheads_q, rows) with each sequence from a multiple of 128.

    Args:
        dout, out: (batch, seqlen_q, nheads_q, headdim) like q; lse: the forward's (batch, nheads_q,
            seqlen_q) float32 (packed batches: (total, heads, headdim) and (nheads_q, total_q)). dq: like q,
            dk/dv: like k/v, any strides the kernels can write (see `_grad_like`); written (packed: rows of
            the sequences only).
        deterministic: bitwise-reproducible dq (key blocks add into it in a fixed order; slower).
        dlse: gradient of lse (same shape), or None for zero.
        plan, softcap, varlen, alibi_slopes, dropout: as for `fwd_into` (dropout: the forward's p and rng).
        blocks: a block mask's transposed lists (block_q_count, ...) for `_C.bwd`'s block-sparse kernels.
    """
    ext, why = _build_info.load_extension()
    if ext is None:
        raise RuntimeError(why)
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t.shape != like.shape or t.dtype != like.dtype or not _tma_strides_ok(t) or t.data_ptr() % 16:
            raise ValueError(
                f"{name} must be a {like.dtype} tensor of shape {tuple(like.shape)}, 16-byte aligned, with a "
                "contiguous last dim and the other strides multiples of 8 elements (a contiguous one will do)"
            )
    d, dv_dim = q.shape[-1], v.shape[-1]
    dpad, dvpad = _kernel_dims(d, dv_dim)
    padded = (dpad, dvpad) != (d, dv_dim)
    if padded:
        # As in fwd_into: zero columns change no score; the padded gradient columns are dropped.
        q, k = (torch.nn.functional.pad(t, (0, dpad - d)) for t in (q, k))
        dout, v, out = (torch.nn.functional.pad(t, (0, dvpad - dv_dim)) for t in (dout, v, out))
        dq_k, dk_k, dv_k = (t.new_zeros(*t.shape) for t in (q, k, v))
    else:
        dq_k, dk_k, dv_k = dq, dk, dv
    dpsum = ext.bwd(
        _tma_ready(dout),
        _tma_ready(q),
        _tma_ready(k),
        _tma_ready(v),
        _tma_ready(out),
        lse.contiguous(),
        dq_k,
        dk_k,
        dv_k,
        float(softmax_scale),
        bool(plan.causal),
        bool(deterministic),
        None if dlse is None else dlse.float().contiguous(),
        **_kernel_options(plan, softcap, varlen),
        **(blocks or {}),
        **_alibi_arg(alibi_slopes),
        **_dropout_arg(dropout),
    )
    if padded:
        dq.copy_(dq_k[..., :d])
        dk.copy_(dk_k[..., :d])
        dv.copy_(dv_k[..., :dv_dim])
    return dpsum


def _reference_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
) -> tuple[Tensor, Tensor]:
    out, lse = reference.attention_ref(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window, softcap=softcap
    )
    return out.contiguous(), lse.contiguous()


def eager_direct(*tensors: Optional[Tensor]) -> bool:
    """Whether calling an op's implementation directly is indistinguishable from dispatching it (which costs
    about 10 us of host time per call, as much as a whole decode step's kernels): plain CUDA tensors, no
    gradient wanted, and nothing tracing or intercepting the call (torch.compile, dispatch or function
    modes, functorch transforms). The public functions take this shortcut; everything else dispatches."""
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
    ):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not Tensor or not t.is_cuda or (grad and t.requires_grad)):
            return False
    return True


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def fwd_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    num_splits: int = 0,
) -> tuple[Tensor, Tensor]:
    """Forward. q (b, sq, hq, d), k/v (b, sk, hk, d) -> out (b, sq, hq, d) q.dtype, lse (b, hq, sq) fp32.

    `deterministic` does not change the forward (always deterministic); autograd hands it to `bwd`.
    Short query blocks (decoding) and forced `num_splits` > 1 run the split-KV decode kernel
    (`_ops_kvcache`); its out and lse feed the same backward.

    Inputs are assumed validated (`interface.attn` does that). lse is float32, except float64 for
    float64 inputs (CPU reference only), so that gradcheck can check gradients through lse.
    """
    plan, why = _kernel_plan(
        q, q.shape[1], k.shape[1], causal, window_left, window_right, v.shape[-1], mla=True
    )
    if plan is None:
        if why and q.is_cuda:
            _warn_once(why)
        return _reference_fwd(q, k, v, softmax_scale, causal, (window_left, window_right), softcap)
    b, sq, hq, d = q.shape
    out = q.new_empty(b, sq, hq, v.shape[-1])
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)

    mla = v.shape[-1] != d  # the decode kernels take one head dim
    if not mla and _ops_kvcache.use_decode(q.shape[1], q.shape[2], k.shape[2], d, num_splits, q.device):
        _ops_kvcache.decode_into(
            q, _tma_ready(k), _tma_ready(v), out, lse, softmax_scale, plan.causal, plan.window_left,
            plan.window_right, softcap, num_splits,
        )  # fmt: skip
        return out, lse
    fwd_into(q, k, v, out, lse, softmax_scale, plan, softcap=softcap)
    return out, lse


fwd = torch.library.custom_op("flash_attn4::fwd", mutates_args=())(fwd_impl)


@fwd.register_fake
def _fwd_fake(
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic, num_splits=0
):
    b, sq, hq, _ = q.shape
    return q.new_empty(b, sq, hq, v.shape[-1]), torch.empty(
        b, hq, sq, dtype=_lse_dtype(q.dtype), device=q.device
    )


@torch.library.custom_op("flash_attn4::bwd", mutates_args=())
def bwd(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward. dout (b, sq, hq, d), dlse (b, hq, sq) or None -> dq like q, dk like k, dv like v.

    Gradients through lse are exact on both paths. The CUDA path is the backward kernel of the forward's
    family (recomputes P from q, k and the saved lse); `deterministic` makes its dq bitwise reproducible.
    Otherwise (CPU, or no kernel for the call) `reference.attention_bwd_ref` runs (float32 math,
    float64 for float64 inputs; written out rather than taken with torch.func.vjp, which breaks under
    dispatch modes such as opcheck's schema check), with a one-time warning on CUDA.
    """
    plan, why = _kernel_plan(
        q, q.shape[1], k.shape[1], causal, window_left, window_right, v.shape[-1], mla=True
    )
    if plan is not None:
        dq, dk, dv = (_grad_like(t) for t in (q, k, v))
        bwd_into(
            dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, plan, deterministic, dlse, softcap=softcap
        )
        return dq, dk, dv
    if why and q.is_cuda:
        _warn_once(why)
    grads = reference.attention_bwd_ref(
        dout,
        q,
        k,
        v,
        dlse=dlse,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=(window_left, window_right),
        softcap=softcap,
        out=out,  # the forward's, reused where it is exact (fp32 / fp64 inputs)
        lse=lse,
    )
    return tuple(_in_grad_layout(g, t) for g, t in zip(grads, (q, k, v)))


@bwd.register_fake
def _bwd_fake(dout, dlse, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, det):
    return _grad_like(q), _grad_like(k), _grad_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic = inputs[:9]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (softmax_scale, causal, window_left, window_right, softcap, deterministic)
    # An unused output (lse, usually) then arrives as None instead of a tensor of zeros: the kernel skips
    # the dlse term instead of reading zeros.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
    q, k, v, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv = bwd(dout, dlse, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


# The packed-batch ops live beside these (registered on import, as these are).
from flash_attn4 import _ops_alibi, _ops_dropout, _ops_kvcache, _ops_sinks, _ops_sparse, _ops_varlen  # noqa: E402, F401
