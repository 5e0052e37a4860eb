"""Opt-in host-side checks of the values the kernels read on the device (lengths, offsets, page ids,
batch indices). The kernels never fault on values that lie (they clamp, as documented), but a clamped call
computes something the caller probably did not mean; with checks on, such a call raises a ValueError that
says which value is wrong instead.

    FLASH_ATTN4_CHECK=1 python train.py      # at import
    flash_attn4.enable_checks()              # or at run time (enable_checks(False) turns them off)

Each check copies the small index tensors to the host, so it synchronizes the stream and cannot run inside
a CUDA graph capture or torch.compile: leave it off in production and on while debugging.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

_enabled = os.environ.get("FLASH_ATTN4_CHECK", "0") == "1"


def enable_checks(flag: bool = True) -> None:
    """Turn the host-side checks of device values on (or off)."""
    global _enabled
    _enabled = bool(flag)


def checks_enabled() -> bool:
    return _enabled and not torch.compiler.is_compiling()


def _host(t: Tensor | None) -> list[int] | None:
    return None if t is None else t.detach().to("cpu", torch.int64).tolist()


def check_kvcache(k_cache: Tensor, seqlen_new: int, cache_seqlens: Tensor, page_table: Tensor | None,
                  cache_batch_idx: Tensor | None, cache_leftpad: Tensor | None) -> None:  # fmt: skip
    """attn_with_kvcache: every sequence's filled rows plus the appended ones fit its cache, leftpad lies in
    them, batch indices pick existing rows, and the pages those rows live in exist."""
    lens = _host(cache_seqlens)
    paged = page_table is not None
    page = k_cache.shape[1] if paged else 0
    capacity = page_table.shape[1] * page if paged else k_cache.shape[1]
    for b, n in enumerate(lens):
        if n < 0 or n + seqlen_new > capacity:
            raise ValueError(
                f"cache_seqlens[{b}] = {n} (+ {seqlen_new} appended) must lie in [0, {capacity}], "
                "the cache's capacity"
            )
    if cache_leftpad is not None:
        for b, (lp, n) in enumerate(zip(_host(cache_leftpad), lens)):
            if not 0 <= lp <= n + seqlen_new:
                raise ValueError(
                    f"cache_leftpad[{b}] = {lp} must lie in [0, cache_seqlens[{b}] + seqlen_new]"
                )
    if cache_batch_idx is not None:
        for b, i in enumerate(_host(cache_batch_idx)):
            if not 0 <= i < k_cache.shape[0]:
                raise ValueError(
                    f"cache_batch_idx[{b}] = {i} must lie in [0, {k_cache.shape[0]}), the cache's rows"
                )
    if paged:
        table = _host(page_table)
        for b, n in enumerate(lens):
            used = (n + seqlen_new + page - 1) // page
            for j, pid in enumerate(table[b][:used]):
                if not 0 <= pid < k_cache.shape[0]:
                    raise ValueError(
                        f"page_table[{b}, {j}] = {pid} (tokens {j * page}..{(j + 1) * page - 1}) must lie "
                        f"in [0, {k_cache.shape[0]}), the pool's pages"
                    )


def check_varlen(total_q: int, total_k: int, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                 max_seqlen_k: int, seqused_q: Tensor | None, seqused_k: Tensor | None) -> None:  # fmt: skip
    """attn_varlen: offsets start at >= 0, never decrease, end within the packed tensors; every length is
    at most max_seqlen; seqused shortens, never lengthens, a sequence."""
    for name, cu, total, mx, used in (("q", cu_seqlens_q, total_q, max_seqlen_q, seqused_q),
                                      ("k", cu_seqlens_k, total_k, max_seqlen_k, seqused_k)):  # fmt: skip
        off = _host(cu)
        if off[0] < 0:
            raise ValueError(f"cu_seqlens_{name}[0] = {off[0]} must be >= 0")
        for b in range(len(off) - 1):
            n = off[b + 1] - off[b]
            if n < 0:
                raise ValueError(f"cu_seqlens_{name} decreases at {b}: {off[b]} -> {off[b + 1]}")
            if n > mx:
                raise ValueError(f"sequence {b} has {n} {name} rows, more than max_seqlen_{name} = {mx}")
        if off[-1] > total:
            raise ValueError(f"cu_seqlens_{name}[-1] = {off[-1]} is past the {total} packed {name} rows")
        if used is not None:
            for b, u in enumerate(_host(used)):
                if not 0 <= u <= off[b + 1] - off[b]:
                    raise ValueError(f"seqused_{name}[{b}] = {u} must lie in [0, {off[b + 1] - off[b]}]")
