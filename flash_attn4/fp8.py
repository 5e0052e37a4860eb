"""FP8 (e4m3) inputs for attention: quantization with descales, and the orthogonal (Hadamard) rotation that
spreads outlier channels before quantizing q and k.

    q8, q_descale = flash_attn4.quantize_fp8(q)            # per (sequence, head): descale (batch, nheads)
    k8, k_descale = flash_attn4.quantize_fp8(k, granularity="block", block_size=128)
    qr, kr = flash_attn4.hadamard_rotate(q, k)              # q k^T unchanged; quantize qr, kr instead

x ~= x_fp8.float() * descale (broadcast per head, or per head and block of tokens). e4m3 has 3 mantissa bits
and a largest finite value of 448: a scale per head maps each head's largest magnitude to 448, so one
outlier channel (LLM activations have a few, 20-100x the rest) costs the other channels their precision.
Rotating the head dim by an orthonormal Hadamard matrix H (q H (k H)^T = q k^T) spreads each outlier over
all channels first ("incoherent processing", QuaRot / FA3). tools/fp8_error.py measures what each choice
costs; docs/design.md ("FP8 inputs") has its table.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

E4M3_MAX = 448.0
_GRANULARITIES = ("tensor", "head", "block")


def _check_4d(x: Tensor, name: str) -> None:
    if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point (batch, seqlen, nheads, headdim) tensor")


def quantize_fp8(
    x: Tensor,
    *,
    granularity: str = "head",
    block_size: int = 128,
    dtype: torch.dtype = torch.float8_e4m3fn,
    nheads_kv: int | None = None,
) -> tuple[Tensor, Tensor]:
    """x (batch, seqlen, nheads, headdim) -> (x_fp8 like x, descale float32).

    granularity: "head" -> descale (batch, nheads), the shape the kernels' q/k/v_descale take (for q under
    GQA pass nheads_kv: one scale per group of nheads / nheads_kv query heads, (batch, nheads_kv)); "block" ->
    (batch, nheads, ceil(seqlen / block_size)), one scale per head and block of block_size tokens; "tensor"
    -> a 0-dim descale. Each scale maps the largest magnitude in its group to the format's largest finite
    value; an all-zero group gets descale 1. x is not modified.
    """
    _check_4d(x, "x")
    if granularity not in _GRANULARITIES:
        raise ValueError(f"granularity must be one of {_GRANULARITIES}, got {granularity!r}")
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    fmax = torch.finfo(dtype).max
    xf = x.detach().float()
    b, s, h, d = xf.shape
    if nheads_kv is not None:
        if granularity != "head" or isinstance(nheads_kv, bool) or not isinstance(nheads_kv, int):
            raise ValueError("nheads_kv (an int) goes with granularity='head'")
        if nheads_kv < 1 or h % nheads_kv:
            raise ValueError(f"nheads ({h}) must be a multiple of nheads_kv ({nheads_kv})")
        x8, descale = quantize_fp8(x.reshape(b, s, nheads_kv, h // nheads_kv * d), dtype=dtype)
        return x8.view(b, s, h, d), descale
    if granularity == "tensor":
        amax = xf.abs().amax()
        expand = amax
    elif granularity == "head":
        amax = xf.abs().amax(dim=(1, 3))  # (b, h)
        expand = amax[:, None, :, None]
    else:
        nblk = max(1, math.ceil(s / block_size))
        padded = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, nblk * block_size - s))
        amax = padded.abs().view(b, nblk, block_size, h, d).amax(dim=(2, 4)).transpose(1, 2)  # (b, h, nblk)
        expand = amax.transpose(1, 2).repeat_interleave(block_size, dim=1)[:, :s, :, None]
    descale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    scale = torch.where(expand > 0, fmax / expand, torch.ones_like(expand))
    x_fp8 = (xf * scale).clamp_(-fmax, fmax).to(dtype)
    return x_fp8, descale.to(torch.float32)


def dequantize_fp8(x_fp8: Tensor, descale: Tensor, *, block_size: int = 128) -> Tensor:
    """The float32 values an fp8 tensor and its descale (any granularity of `quantize_fp8`) stand for."""
    _check_4d(x_fp8, "x_fp8")
    xf = x_fp8.float()
    b, s, h, _ = xf.shape
    if descale.dim() == 0:
        return xf * descale
    if descale.shape == (b, h):
        return xf * descale[:, None, :, None]
    if descale.dim() == 3 and descale.shape[:2] == (b, h):
        per_token = descale.transpose(1, 2).repeat_interleave(block_size, dim=1)[:, :s]
        return xf * per_token[..., None]
    raise ValueError(f"descale of shape {tuple(descale.shape)} does not fit x of shape {tuple(xf.shape)}")


def hadamard_matrix(n: int, *, device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """The orthonormal (n, n) Hadamard matrix (Sylvester), n a power of two: H H^T = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, device=device, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / math.sqrt(n)).to(dtype)


def _rotation(d: int, device, dtype: torch.dtype = torch.float32) -> Tensor:
    """Block-diagonal orthonormal Hadamard of size d: blocks of the largest power of two dividing d (so 192
    uses three 64 x 64 blocks)."""
    block = d & -d
    h = hadamard_matrix(block, device=device, dtype=dtype)
    return torch.block_diag(*([h] * (d // block))) if block < d else h


def hadamard_rotate(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """(q H, k H) with H an orthonormal Hadamard matrix over the head dim, in q's and k's dtypes (computed in
    float32, float64 for float64 inputs): q k^T, hence the attention, is unchanged up to rounding, while
    outlier channels are spread over all channels before quantization. v is not rotated (the output would
    be rotated with it)."""
    _check_4d(q, "q")
    _check_4d(k, "k")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim, got {q.shape[-1]} and {k.shape[-1]}")
    cdt = torch.float64 if torch.float64 in (q.dtype, k.dtype) else torch.float32
    h = _rotation(q.shape[-1], q.device, cdt)
    return (q.to(cdt) @ h).to(q.dtype), (k.to(cdt) @ h).to(k.dtype)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _descale(name: str, t: Tensor | None, x: Tensor) -> Tensor:
    """A (batch, nheads_kv) fp32 descale (None = 1) broadcast to x's (batch, seqlen, nheads, 1)."""
    b, _, h, _ = x.shape
    if t is None:
        return torch.ones(b, 1, h, 1, device=x.device)
    if not isinstance(t, Tensor) or t.dim() != 2 or t.shape[0] != b or t.device != x.device:
        raise ValueError(f"{name} must be a (batch, nheads_kv) float32 tensor on {x.device}")
    return t.float().repeat_interleave(h // t.shape[1], dim=1)[:, None, :, None]


def attn_fp8(
    q: Tensor, k: Tensor, v: Tensor, q_descale, k_descale, v_descale, **options
) -> tuple[Tensor, Tensor]:
    """`attn` of fp8 q, k, v (values x descale): forward only, output bfloat16, lse float32. On Hopper the
    e4m3 kernels run (head dims in _build_info.FP8_HDIMS, no softcap); elsewhere the PyTorch reference runs on
    the dequantized inputs (the math the kernels are measured against), with a warning on CUDA."""
    from flash_attn4 import _ops, _ops_fp8, reference

    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_4d(t, name)
        if t.dtype not in FP8_DTYPES:
            raise TypeError(f"fp8 attention takes q, k and v all in fp8; {name} is {t.dtype}")
        if t.requires_grad:
            raise TypeError(
                "fp8 attention is forward-only: train in bf16 (cast q, k, v with .to(torch.bfloat16))"
            )
    if (
        k.shape != v.shape
        or q.shape[0] != k.shape[0]
        or q.shape[-1] != k.shape[-1]
        or q.shape[2] % k.shape[2]
    ):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: shapes do not match")
    hk = k.shape[2]
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None and (
            not isinstance(t, Tensor) or t.dim() != 2 or t.shape != (q.shape[0], hk) or t.device != q.device
        ):
            raise ValueError(
                f"{name} must be (batch, nheads_kv) = ({q.shape[0]}, {hk}), float32, on {q.device}"
            )
    why = _ops_fp8.kernel_reason(q, k, v, options.get("softcap", 0.0))
    if not why:
        left, right = options.get("window_size", (-1, -1))
        return torch.ops.flash_attn4.fwd_fp8(
            q, k, v, q_descale, k_descale, v_descale, float(options["softmax_scale"]),
            bool(options.get("causal", False)), int(left), int(right),
        )  # fmt: skip
    if q.is_cuda:
        _ops._warn_once(f"fp8 attention: {why}; the PyTorch reference runs on the dequantized inputs")
    qf = q.float() * _descale("q_descale", q_descale, q)
    kf = k.float() * _descale("k_descale", k_descale, k)
    vf = v.float() * _descale("v_descale", v_descale, v)
    out, lse = reference.attention_ref(qf, kf, vf, **options)
    return out.to(torch.bfloat16), lse.float()
