"""Checks of `attn` / `attn_varlen`'s option arguments (block masks, ALiBi slopes, dropout) that raise a
clear error before any kernel runs."""

from __future__ import annotations

import warnings
from numbers import Real
from typing import Any

from torch import Tensor


def _validate_block_mask(mask: Any, seqlen_q: int, seqlen_k: int, batch: int, heads: int, device,
                         lengths: str = "seqlen_q, seqlen_k") -> None:  # fmt: skip
    """A BlockMask built for (seqlen_q, seqlen_k) (`lengths` names them in the message), batch and heads 1
    or the call's, on the call's device."""
    if mask is None:
        return
    from flash_attn4.block_mask import BlockMask

    if not isinstance(mask, BlockMask):
        raise TypeError(f"block_mask must be a flash_attn4.BlockMask, got {type(mask).__name__}")
    if (mask.seqlen_q, mask.seqlen_k) != (seqlen_q, seqlen_k):
        raise ValueError(
            f"block_mask was built for seqlen_q {mask.seqlen_q}, seqlen_k {mask.seqlen_k}; this call's "
            f"({lengths}) are ({seqlen_q}, {seqlen_k})"
        )
    mb, mh = mask.shape
    if mb not in (1, batch) or mh not in (1, heads):
        raise ValueError(f"block_mask's (batch, heads) {(mb, mh)} must be 1 or this call's {(batch, heads)}")
    if mask.kv_count.device != device:
        raise ValueError(f"block_mask is on {mask.kv_count.device}, q on {device}; use block_mask.to(...)")


def _validate_alibi(slopes: Any, batch: int, heads: int, device) -> None:
    if slopes is None:
        return
    if not isinstance(slopes, Tensor) or tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(
            f"alibi_slopes must be a (nheads_q,) = ({heads},) or (batch, nheads_q) = ({batch}, {heads}) "
            f"tensor, got {tuple(slopes.shape) if isinstance(slopes, Tensor) else type(slopes).__name__}"
        )
    if not slopes.is_floating_point() or slopes.device != device:
        raise TypeError(f"alibi_slopes must be a floating-point tensor on q's device {device}")


def _validate_dropout(p: Any) -> float:
    if isinstance(p, bool) or not isinstance(p, Real) or not 0 <= float(p) < 1:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {p!r}; pass 0.0 at inference")
    if 0 < float(p) < 1 / 512:
        # The drop rate is p rounded to a multiple of 1 / 256 (flash_attn4.dropout.threshold).
        warnings.warn(f"dropout_p={float(p)!r} rounds to a drop rate of 0 (rates are multiples of 1/256): "
                      "no probability is dropped", stacklevel=3)  # fmt: skip
    return float(p)
