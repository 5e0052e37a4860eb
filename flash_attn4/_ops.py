"""torch.library custom ops: the one autograd path.

    flash_attn4::fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic)
        -> (out, lse)
    flash_attn4::bwd(dout, dlse?, q, k, v, out, lse, softmax_scale, causal, window_left, window_right,
                     softcap, deterministic) -> (dq, dk, dv)

Both have fake (meta) implementations, so torch.compile(fullgraph=True) and CUDA-graph capture trace
through them. Each call goes to the compiled kernel when one can serve it (see `_kernel_plan`), else to
`reference.attention_ref`; a CUDA call that falls back warns once per reason.

No `from __future__ import annotations` here: custom_op reads the schema from real annotations.
"""

import warnings
from typing import Optional

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


def _kernel_plan(
    q: Tensor, k: Tensor, causal: bool, window_left: int, window_right: int, softcap: float
) -> tuple[Optional[bool], str]:
    """Decide the path. Returns (causal for the kernel, "") or (None, why the reference runs)."""
    if q.numel() == 0 or k.shape[1] == 0:
        return None, ""  # nothing to compute (or only empty rows): no kernel launch, nothing to warn about
    ok, why = _build_info.kernel_available(q.device, q.dtype, q.shape[-1])
    if not ok:
        return None, why
    if softcap != 0.0:
        return None, "softcap is not implemented in the CUDA kernel yet; pass softcap=0.0 for the fast path"
    left, right = _effective_mask(q.shape[1], k.shape[1], causal, window_left, window_right)
    if left != -1 or right not in (-1, 0):
        return None, (
            "sliding-window attention is not implemented in the CUDA kernel yet; "
            "use window_size=(-1, -1) (optionally causal=True) for the fast path"
        )
    return right == 0, ""


def _tma_ready(t: Tensor) -> Tensor:
    """`t` itself when the kernel can read it in place, else a contiguous copy.

    TMA needs a last-dim stride of 1, every other stride a multiple of 8 elements (16 bytes) and a
    16-byte aligned base. A stride of 0 on a dim of size > 1 (an expanded tensor) is copied too: a TMA
    descriptor is not meant to describe overlapping rows. `clone`, not `contiguous`: the latter returns a
    misaligned or odd-strided size-1 tensor unchanged because it already counts as contiguous.
    """
    ok = (
        t.stride(-1) == 1
        and all(s % 8 == 0 and (s != 0 or n == 1) for s, n in zip(t.stride()[:-1], t.shape[:-1]))
        and t.data_ptr() % 16 == 0
    )
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def fwd_into(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float, causal: bool
) -> None:
    """Run the compiled forward kernel, writing every element of `out` and `lse`.

    Args:
        q: (batch, seqlen_q, nheads_q, headdim) fp16/bf16 on an sm90 device; k, v: (batch, seqlen_k,
            nheads_kv, headdim), same dtype. Any strides; copies are made only where TMA needs them.
        out: (batch, seqlen_q, nheads_q, headdim), q's dtype, contiguous. Written.
        lse: (batch, nheads_q, seqlen_q) float32, contiguous. Written.
        softmax_scale: for the ORIGINAL head dim (padding below must not change it).
    """
    ext, why = _build_info.load_extension()
    if ext is None:
        raise RuntimeError(why)
    b, sq, hq, d = q.shape
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}")
    if lse.shape != (b, hq, sq) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"lse must be a contiguous float32 tensor of shape {(b, hq, sq)}")
    dpad = _build_info.padded_hdim(d)
    if dpad is None:
        raise ValueError(f"head dim {d} has no built kernel (built: {_build_info.HDIMS})")
    if dpad != d:
        # Zero columns add nothing to q.k and produce zero output columns, which are dropped.
        pad = (0, dpad - d)
        q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
        out_k = out.new_empty(b, sq, hq, dpad)
    else:
        out_k = out
    ext.fwd(_tma_ready(q), _tma_ready(k), _tma_ready(v), out_k, lse, float(softmax_scale), bool(causal))
    if out_k is not out:
        out.copy_(out_k[..., :d])


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
    causal: bool,
    deterministic: bool = False,
    dlse: Optional[Tensor] = None,
) -> None:
    """Run the compiled sm90 backward kernel, writing dq, dk and dv.

    Args:
        dout, out: (batch, seqlen_q, nheads_q, headdim) like q; lse: the forward's (batch, nheads_q,
            seqlen_q) float32. dq: like q, dk/dv: like k/v, contiguous; written.
        deterministic: bitwise-reproducible dq (key blocks add into it in a fixed order; slower).
        dlse: gradient of lse (same shape), or None for zero.
    """
    ext, why = _build_info.load_extension()
    if ext is None or not hasattr(ext, "bwd"):
        raise RuntimeError(why or "this build of flash_attn4._C has no backward kernels")
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t.shape != like.shape or t.dtype != like.dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {like.dtype} tensor of shape {tuple(like.shape)}")
    d = q.shape[-1]
    dpad = _build_info.backward_padded_hdim(q.dtype, d, q.device)
    if dpad is None:
        raise ValueError(f"head dim {d} has no built backward kernel for {q.dtype}")
    if dpad != d:
        # As in fwd_into: zero columns change no score; the padded gradient columns are dropped.
        pad = (0, dpad - d)
        dout, q, k, v, out = (torch.nn.functional.pad(t, pad) for t in (dout, q, k, v, out))
        dq_k, dk_k, dv_k = (t.new_empty(*t.shape) for t in (q, k, v))
    else:
        dq_k, dk_k, dv_k = dq, dk, dv
    ext.bwd(
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
        bool(causal),
        bool(deterministic),
        None if dlse is None else dlse.float().contiguous(),
    )
    if dpad != d:
        dq.copy_(dq_k[..., :d])
        dk.copy_(dk_k[..., :d])
        dv.copy_(dv_k[..., :d])


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


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("flash_attn4::fwd", mutates_args=())
def fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """Forward. q (b, sq, hq, d), k/v (b, sk, hk, d) -> out (b, sq, hq, d) q.dtype, lse (b, hq, sq) fp32.

    `deterministic` does not change the forward (always deterministic); autograd hands it to `bwd`.

    Inputs are assumed validated (`interface.attn` does that). lse is float32, except float64 for
    float64 inputs (CPU reference only), so that gradcheck can check gradients through lse.
    """
    kernel_causal, why = _kernel_plan(q, k, causal, window_left, window_right, softcap)
    if kernel_causal is None:
        if why and q.is_cuda:
            _warn_once(why)
        return _reference_fwd(q, k, v, softmax_scale, causal, (window_left, window_right), softcap)
    b, sq, hq, d = q.shape
    out = q.new_empty(b, sq, hq, d)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    fwd_into(q, k, v, out, lse, softmax_scale, kernel_causal)
    return out, lse


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic):
    b, sq, hq, d = q.shape
    return q.new_empty(b, sq, hq, d), torch.empty(b, hq, sq, dtype=_lse_dtype(q.dtype), device=q.device)


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

    Gradients through lse are exact on both paths. The CUDA path is the sm90 backward kernel (recomputes
    P from q, k and the saved lse); `deterministic` makes its dq bitwise reproducible. Otherwise (CPU,
    options or head dims without a backward kernel) `reference.attention_bwd_ref` runs (float32 math,
    float64 for float64 inputs; written out rather than taken with torch.func.vjp, which breaks under
    dispatch modes such as opcheck's schema check), with a one-time warning on CUDA.
    """
    kernel_causal, why = _kernel_plan(q, k, causal, window_left, window_right, softcap)
    if kernel_causal is not None:
        if _build_info.backward_padded_hdim(q.dtype, q.shape[-1], q.device) is not None:
            dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
            bwd_into(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, kernel_causal, deterministic, dlse)
            return dq, dk, dv
        _warn_once(
            f"head dim {q.shape[-1]} has a forward kernel but no backward kernel yet (backward head dims: "
            f"{_build_info.backward_hdims(_build_info.dtype_name(q.dtype))}); the gradient is computed there"
        )
    elif why and q.is_cuda:
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
    )
    return tuple(g.contiguous() for g in grads)


@bwd.register_fake
def _bwd_fake(dout, dlse, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, det):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic = inputs
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
    return dq, dk, dv, None, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


# Variable-length (packed) batches. No CUDA kernel serves these yet (the varlen issue adds one): every call
# runs reference.attention_varlen_ref, which reads cu_seqlens on the host.
_VARLEN_NO_KERNEL = (
    "variable-length attention has no CUDA kernel yet; attn_varlen runs on the PyTorch reference "
    "(per-sequence loop, host sync on cu_seqlens)"
)


@torch.library.custom_op("flash_attn4::fwd_varlen", mutates_args=())
def fwd_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    seqused_q: Optional[Tensor],
    seqused_k: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
) -> tuple[Tensor, Tensor]:
    """Varlen forward. q (total_q, hq, d), k/v (total_k, hk, d) -> out like q, lse (hq, total_q)."""
    if q.is_cuda:
        _warn_once(_VARLEN_NO_KERNEL)
    out, lse = reference.attention_varlen_ref(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_q=seqused_q,
        seqused_k=seqused_k,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=(window_left, window_right),
        softcap=softcap,
    )
    return out.contiguous(), lse.contiguous()


@fwd_varlen.register_fake
def _fwd_varlen_fake(
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, softmax_scale, causal, wl, wr, softcap
):
    total_q, hq, d = q.shape
    return q.new_empty(total_q, hq, d), torch.empty(hq, total_q, dtype=_lse_dtype(q.dtype), device=q.device)


@torch.library.custom_op("flash_attn4::bwd_varlen", mutates_args=())
def bwd_varlen(
    dout: Tensor,
    dlse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    seqused_q: Optional[Tensor],
    seqused_k: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Varlen backward (reference): dq like q, dk like k, dv like v; gradients through lse included."""
    grads = reference.attention_varlen_bwd_ref(
        dout,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        dlse=dlse,
        seqused_q=seqused_q,
        seqused_k=seqused_k,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=(window_left, window_right),
        softcap=softcap,
    )
    return tuple(g.contiguous() for g in grads)


@bwd_varlen.register_fake
def _bwd_varlen_fake(dout, dlse, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context_varlen(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, used_q, used_k, *args = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k)
    ctx.used = (used_q, used_k)
    ctx.args = tuple(args)


def _backward_varlen(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
    q, k, v, cu_q, cu_k = ctx.saved_tensors
    dout = torch.zeros_like(q) if dout is None else dout
    if dlse is None:
        dlse = torch.zeros(q.shape[1], q.shape[0], dtype=_lse_dtype(q.dtype), device=q.device)
    dq, dk, dv = bwd_varlen(dout, dlse, q, k, v, cu_q, cu_k, *ctx.used, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


fwd_varlen.register_autograd(_backward_varlen, setup_context=_setup_context_varlen)
