"""What the option kernels' GPU tests (ALiBi, dropout, MLA) share: why they skip, and dense attention in the
kernels' precisions as their reference (q k^T and P v in q's dtype, the bias and the softmax in fp32, fp64 for
fp64 inputs; bottom-right aligned causal / window masks; GQA by repeating k and v; v may be narrower than q
and k)."""

from __future__ import annotations

import math

import torch

from flash_attn4 import _build_info

# The built dtypes, and the shapes every option kernel is tested on: no mask, causal, windows, odd lengths,
# seqlen_q != seqlen_k both ways, GQA / MQA (sq, sk, causal, window, hq, hk).
DTYPES = [dt for dt, n in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")) if n in _build_info.DTYPES]
CASES = [
    (1023, 1023, False, (-1, -1), 4, 2),
    (1023, 1023, True, (-1, -1), 4, 4),
    (517, 2048, True, (-1, -1), 8, 2),
    (2048, 517, False, (-1, -1), 4, 1),
    (1024, 1024, False, (300, 100), 4, 2),
    (113, 239, False, (-1, -1), 4, 2),
]


def gpu_skip(built: tuple, what: str, how: str = "") -> str | None:
    """Why the sm90 `what` kernels cannot run here (None if they can): `built` is their _build_info head dims,
    `how` says how to build them."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not built:
        return f"no {what} kernels in this build{how and f' ({how})'}"
    arch, why = _build_info.kernel_arch(torch.device("cuda"))
    return None if arch == 90 else f"the {what} kernels are sm90 ones ({why or f'this GPU takes sm{arch}'})"


def dense(q, k, v, causal=False, window=(-1, -1), slopes=None, keep=None, keep_scale=1.0):
    """out (b, sq, hq, dv) and lse (b, hq, sq) of softmax(q k^T / sqrt(d) - slope_h |i + sk - sq - j|, masked)
    with the probabilities times keep * keep_scale where a dropout keep mask (b, hq, sq, sk) is given (lse is
    that of the probabilities before dropout). ALiBi slopes: (hq,) or (b, hq). A row that sees no key gets
    out = 0, lse = -inf."""
    sq, sk, hq, hk, d = q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    kk, vv = (t.repeat_interleave(hq // hk, dim=2) for t in (k, v))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk).to(acc) / math.sqrt(d)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    if slopes is not None:
        s = s - slopes.to(s.dtype).reshape(-1, hq, 1, 1) * (i - j).abs().to(s.dtype)
    left, right = window
    right = 0 if causal else right
    seen = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        seen &= j <= i + right
    if left >= 0:
        seen &= j >= i - left
    s = s.masked_fill(~seen, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if keep is not None:
        p = p * keep * keep_scale
    return torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype), vv), torch.logsumexp(s, -1)
