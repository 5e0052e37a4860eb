"""HuggingFace transformers integration: run a model's attention on flash_attn4.

    import flash_attn4
    flash_attn4.patch_transformers(model)        # this model, now
    flash_attn4.patch_transformers()             # every model that would use "sdpa" (the default)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fa4")  # after register()

The attention function follows transformers' flash-attention contract (shared/research/hf_integration.md):
q/k/v arrive as (batch, heads, seqlen, head_dim) with k/v not repeated for GQA, the output goes back as
(batch, seqlen, heads, head_dim). The mask function registered beside it (`mask_function`, transformers
>= 4.53) hands us the 2-D padding mask (or None when nothing is padded); a padded batch is unpadded into
`attn_varlen` and padded back (left or right padding; pad rows get zeros, never NaN), and decoding passes
it to `attn_with_kvcache` as lengths. Before 4.53 the model passes a 4-D mask, from which the same padding
mask is read (see `_padding_mask`).

The name is "fa4": transformers treats names containing "flash", "sdpa", "flex_attention" or "/"
specially, so ours avoids them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from flash_attn4._ops_kvcache import DECODE_MAX_ROWS
from flash_attn4.interface import attn, attn_varlen
from flash_attn4.kvcache import decode_step

NAME = "fa4"

_saved_sdpa: dict[str, Any] = {}  # the original "sdpa" entries while patch_transformers() overrides them


def _is_compiling() -> bool:
    return bool(getattr(torch.compiler, "is_compiling", lambda: False)())


def mask_function(
    batch_size: int, q_length: int | None = None, kv_length: int = 0, q_offset: int = 0, kv_offset: int = 0,
    mask_function: Any = None, attention_mask: Tensor | None = None, **kwargs: Any,
) -> Tensor | None:  # fmt: skip
    """The mask transformers (>= 4.53) builds for us once per forward: the 2-D padding mask (batch,
    kv_length), True = real token, or None when nothing is padded. Like transformers' flash_attention_mask
    (the last kv_length columns, for sliding windows), with two differences that keep decoding free of host
    synchronisation:

    * A mask shorter than kv_length (a StaticCache: the cache is longer than what is filled) is padded with
      False to kv_length, so its shape is the same at every step and a compiled decoding step is captured
      once (a mask that grows by a column a step would be recompiled / re-recorded every step).
    * Only a long query block asks the host whether anything is padded (so that an unpadded prefill takes the
      dense kernels). Decoding keeps the mask: the decode kernel takes it as per-sequence lengths on the
      device, which costs nothing when nothing is padded, and under torch.compile the mask is always kept.
    """
    if attention_mask is None:
        return None
    if q_length is None:  # transformers < 5 passes cache_position (one entry per query) instead
        q_length = int(kwargs["cache_position"].shape[0])
    mask = attention_mask[:, -kv_length:]
    if mask.dtype != torch.bool:
        mask = mask.bool()
    if mask.shape[1] < kv_length:
        mask = torch.nn.functional.pad(mask, (0, kv_length - mask.shape[1]), value=False)
    elif q_length > DECODE_MAX_ROWS and not _is_compiling() and bool(mask.all()):
        return None
    return mask


_SLOTS: dict[torch.device, Tensor] = {}  # 1, 2, 3, ... (int32) per device, grown by doubling


def _slots(n: int, device: torch.device) -> Tensor:
    """torch.arange(1, n + 1, dtype=int32) on `device`, as a view of a cached tensor: a decoding step's
    mask grows by a column a step, and each fresh arange is one more kernel on a host-bound step. Not cached
    while compiling or capturing a CUDA graph (a tensor made there holds its values only in replays)."""
    if _is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.arange(1, n + 1, dtype=torch.int32, device=device)
    have = _SLOTS.get(device)
    if have is None or have.numel() < n:
        have = _SLOTS[device] = torch.arange(1, max(n, 2 * (0 if have is None else have.numel()), 4096) + 1,
                                             dtype=torch.int32, device=device)  # fmt: skip
    return have[:n]


def _filled_length(keep: Tensor) -> Tensor:
    """(batch,) int32: one past each row's last real slot (0 for a row with none), computed on the device
    (two kernels: where, amax)."""
    return torch.where(keep, _slots(keep.shape[1], keep.device), 0).amax(dim=1)


class _PerForward:
    """f(t) memoized on the tensor t itself (its identity and version): transformers hands every layer of one
    forward the same mask and position_ids tensors (models with sliding and full layers alternate between
    two masks), so what is derived from them (a few tiny kernels, or a host synchronisation) is computed by
    the first layer that sees each. Traced (compiled) calls are not memoized."""

    SLOTS = 4

    def __init__(self, f):
        self.f, self.entries = f, []  # [(weakref to t, t's version, f(t))], newest last

    def __call__(self, t: Tensor):
        for ref, version, value in self.entries:
            if ref() is t and version == t._version:
                return value
        value = self.f(t)
        if not _is_compiling():
            self.entries = [e for e in self.entries if e[0]() is not None][-(self.SLOTS - 1) :]
            self.entries.append((weakref.ref(t), t._version, value))
        return value


@_PerForward
def _decode_lengths(keep: Tensor) -> tuple[Tensor, Tensor]:
    """(cache_seqlens, cache_leftpad) of a padding mask, on the device."""
    lens = _filled_length(keep)
    return lens, lens - keep.sum(1, dtype=torch.int32)


def _padding_mask(attention_mask: Tensor | None, kv_len: int) -> Tensor | None:
    """The (batch, L) bool padding mask (True = real token, L <= kv_len), or None when there is none.

    transformers >= 4.53 with our mask function gives exactly that (L = kv_len; trailing False columns are a
    StaticCache's unfilled slots). Older
    versions give a 4-D mask (batch, 1, q_len, kv_len [+1 extra column]), additive float or bool, holding
    causality, padding and any sliding window: a key is real iff some query sees it (each real query sees
    itself; a key no query sees is invisible anyway, and such keys are the oldest ones, so dropping them
    leaves the bottom-right alignment intact), and trailing columns nobody sees (a StaticCache's unfilled
    slots) are cut off.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return attention_mask if attention_mask.dtype == torch.bool else attention_mask.bool()
    if attention_mask.dim() == 4:
        if _is_compiling():
            return None  # data-dependent; under torch.compile the 4-D path assumes no padding
        m = attention_mask[..., :kv_len]
        seen = (m if m.dtype == torch.bool else m == 0).any(dim=2)[:, 0]  # (batch, kv_len)
        cols = torch.nonzero(seen.any(dim=0)).reshape(-1)
        length = int(cols.max()) + 1 if cols.numel() else kv_len
        seen = seen[:, :length]
        return None if length == kv_len and bool(seen.all()) else seen
    raise ValueError(
        f"flash_attn4 ({NAME}) got an attention mask of shape {tuple(attention_mask.shape)}; it takes "
        "transformers' 2-D padding mask or its 4-D causal/padding mask, not arbitrary masks"
    )


def _packed_offsets(position_ids: Tensor | None, batch: int, seqlen: int) -> Tensor | None:
    """cu_seqlens of sequences packed into one row (batch 1; positions restart at each new sequence), or
    None. Reads position_ids on the host (as transformers' flash path does) once per forward; skipped under
    torch.compile."""
    if position_ids is None or batch != 1 or _is_compiling() or position_ids.numel() != seqlen:
        return None
    return _packed_starts(position_ids)


@_PerForward
def _packed_starts(position_ids: Tensor) -> Tensor | None:
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == pos.min()).reshape(-1)
    if starts.numel() <= 1:
        return None
    ends = torch.cat([starts[1:], starts.new_tensor([pos.numel()])])
    return torch.cat([starts[:1] * 0, ends]).to(torch.int32)


def _varlen(q, k, v, cu_q, cu_k, causal, **kw) -> Tensor:
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 0
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if cu_k.numel() > 1 else 0
    return attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, **kw)


def _attn_padded(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, causal: bool, **kw) -> Tensor:
    """q (B, Sq, H, D), k/v (B, Skv, Hk, D), keep (B, L) with L <= Skv: unpad -> attn_varlen -> pad.

    Keys: the first L slots (a StaticCache is longer than what is filled), those with keep set. Queries:
    the last Sq of those L positions (q_len == kv_len, or decoding/chunked prefill after left padding).
    """
    b, sq, h, d = q.shape
    # The filled slots: up to the last one any row uses (a StaticCache's unfilled tail has no real token).
    kv_len = int(_filled_length(keep).max())
    keep = keep[:, :kv_len]
    k, v = k[:, :kv_len], v[:, :kv_len]
    keep_q = keep[:, -sq:] if sq <= kv_len else keep.new_ones(b, sq)
    idx_q = torch.nonzero(keep_q.reshape(-1)).reshape(-1)
    idx_k = torch.nonzero(keep.reshape(-1)).reshape(-1)
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    cu_q = torch.cat([zero, keep_q.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32)])
    cu_k = torch.cat([zero, keep.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32)])
    out = _varlen(
        q.reshape(b * sq, h, d)[idx_q],
        k.reshape(b * kv_len, *k.shape[2:])[idx_k],
        v.reshape(b * kv_len, *v.shape[2:])[idx_k],
        cu_q,
        cu_k,
        causal,
        **kw,
    )
    # Pad rows get 0: finite, so nothing downstream turns into NaN through 0 * NaN.
    dv = out.shape[-1]  # v's head dim (MLA's differs from q's)
    return q.new_zeros(b * sq, h, dv).index_copy(0, idx_q, out).reshape(b, sq, h, dv)


def _decode_padded(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, causal: bool, **kw) -> Tensor:
    """Decoding (or a short chunk) with a padding mask: keep (B, L), L <= Skv (a StaticCache is longer than
    what is filled). Sequence b's keys are slots [n_b - keep[b].sum(), n_b), n_b one past its last real
    slot: generation pads on the left, as transformers requires of decoder-only models, and a StaticCache's
    unfilled slots come after n_b; the queries are the last Sq of those slots. One attn_with_kvcache call
    (`decode_step`), with no host synchronisation (so it also runs inside a compiled graph)."""
    kw.pop("deterministic", None)  # forward only: the decode kernel is deterministic
    lens, leftpad = _decode_lengths(keep)
    return decode_step(q, k, v, lens, leftpad, causal=causal, **kw)


def _target_dtype(query: Tensor, module: torch.nn.Module) -> torch.dtype:
    """As transformers' flash path: fp32 activations run in the autocast dtype, else in the dtype of the
    module's first low-precision Linear weight; a pure fp32 model stays fp32 (the reference path)."""
    if query.dtype != torch.float32:
        return query.dtype
    if torch.is_autocast_enabled():
        get = getattr(torch, "get_autocast_dtype", None)
        return get(query.device.type) if get else torch.get_autocast_gpu_dtype()
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear) and layer.weight.dtype in (torch.float16, torch.bfloat16):
            return layer.weight.dtype
    return query.dtype


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: (B, H, S, D) in, ((B, S, H, D), None) out."""
    b, hq, sq, d = query.shape
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    dtype = _target_dtype(query, module)
    # .to only where it changes something: each no-op call still costs host time on a decoding step.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if not query.dtype == key.dtype == value.dtype == dtype:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kw: dict[str, Any] = {"softmax_scale": scaling, "softcap": float(softcap or 0.0)}
    # transformers passes dropout=0.0 outside training (every 5.x model: `0.0 if not self.training else
    # ...`); module.training is checked too, so a model in eval mode never applies its train-time dropout.
    if dropout and dropout > 0.0 and getattr(module, "training", True):
        kw["dropout_p"] = float(dropout)
    if kwargs.get("s_aux") is not None:  # GPT-OSS's learnable attention sinks, one logit per query head
        kw["sinks"] = kwargs["s_aux"]
    if kwargs.get("deterministic") is not None:
        kw["deterministic"] = bool(kwargs["deterministic"])
    if sliding_window is not None and k.shape[1] > sliding_window:
        # transformers' window: a query sees itself and the sliding_window - 1 keys before it (and, were the
        # layer not causal, as many after it).
        kw["window_size"] = (sliding_window - 1, 0 if causal else sliding_window - 1)

    keep = _padding_mask(attention_mask, k.shape[1])
    decoding = keep is not None and sq < keep.shape[1] and sq * (hq // k.shape[2]) <= DECODE_MAX_ROWS
    if decoding and "dropout_p" not in kw:
        out = _decode_padded(q, k, v, keep, causal, **kw)
    elif keep is not None:
        out = _attn_padded(q, k, v, keep, causal, **kw)
    elif all(kwargs.get(n) is not None for n in ("cu_seq_lens_q", "cu_seq_lens_k")):
        cu_q, cu_k = kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32)
        out = _varlen(q.reshape(b * sq, hq, d), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, causal, **kw)
        out = out.reshape(b, sq, hq, -1)  # -1: v's head dim
    else:
        cu = _packed_offsets(kwargs.get("position_ids"), b, sq) if sq == k.shape[1] else None
        if cu is not None:
            out = _varlen(q[0], k[0], v[0], cu, cu, causal, **kw).unsqueeze(0)
        else:
            # Bottom-right causal: q_len == kv_len is ordinary causal, q_len == 1 (decoding) sees every key,
            # and a chunked prefill sees the cache plus its own causal part.
            out = attn(q, k, v, causal=causal, **kw)
    return (out if out.dtype == query.dtype else out.to(query.dtype)), None


def _interfaces():
    """(AttentionInterface or the pre-4.51 dict, AttentionMaskInterface or None before 4.53)."""
    import transformers.modeling_utils as mu

    attention = getattr(mu, "AttentionInterface", None) or mu.ALL_ATTENTION_FUNCTIONS
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # < 4.53: models build a 4-D additive mask themselves
        return attention, None
    return attention, AttentionMaskInterface


def _register(attention, name: str, fn) -> None:
    if isinstance(attention, dict):
        attention[name] = fn
    else:
        attention.register(name, fn)


def register(name: str = NAME) -> str:
    """Registers our attention (and, on transformers >= 4.53, its padding-mask function) under `name`, so
    `attn_implementation=name` works in from_pretrained / from_config / set_attn_implementation. Idempotent.
    Returns the name."""
    attention, masks = _interfaces()
    _register(attention, name, attention_forward)
    if masks is not None:
        # Without a registered mask function transformers would pass attention_mask=None: padding lost.
        masks.register(name, mask_function)
    return name


def _set_model(model: torch.nn.Module, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # < 4.54: each forward re-reads the config
        for m in model.modules():
            config = getattr(m, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                config._attn_implementation = name


def patch_transformers(model: torch.nn.Module | None = None) -> torch.nn.Module | None:
    """The one-line switch.

    With `model`: registers "fa4" and switches that model to it; returns the model.
    Without: every model whose attention implementation is "sdpa" (transformers' default) runs on
    flash_attn4 from now on, including those already built, until `unpatch_transformers()`: the "sdpa"
    entries of transformers' attention and mask registries point to ours (so such models also get the
    padding mask we need).
    """
    register()
    if model is not None:
        _set_model(model, NAME)
        return model
    attention, masks = _interfaces()
    if not _saved_sdpa:
        table = attention if isinstance(attention, dict) else attention._global_mapping
        _saved_sdpa["attention"] = table.get("sdpa")
        if masks is not None:
            _saved_sdpa["mask"] = masks._global_mapping.get("sdpa")
    _register(attention, "sdpa", attention_forward)
    if masks is not None:
        masks.register("sdpa", mask_function)
    return None


def unpatch_transformers() -> None:
    """Undoes `patch_transformers()` (no model): "sdpa" is transformers' own again."""
    if not _saved_sdpa:
        return
    attention, masks = _interfaces()
    _register(attention, "sdpa", _saved_sdpa.pop("attention"))
    if masks is not None and "mask" in _saved_sdpa:
        masks.register("sdpa", _saved_sdpa.pop("mask"))
    _saved_sdpa.clear()
