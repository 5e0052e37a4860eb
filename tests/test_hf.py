"""HuggingFace transformers integration (flash_attn4.integrations.hf) with tiny random-weight models built
from configs (no downloads): Llama, Mistral (sliding window), Qwen2 (mixed sliding layers) and Gemma-2
(softcap). On CPU the attention runs on the reference path (fp32, tight tolerances); with a CUDA device
and built kernels the bf16 variants run on the kernels (transformers' own bf16 tolerances).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flash_attn4  # noqa: E402
from flash_attn4 import _build_info  # noqa: E402
from flash_attn4.integrations import hf  # noqa: E402

hf.register()
_TF_VERSION = tuple(int(x) for x in transformers.__version__.split(".")[:2])

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(**_COMMON)
    if kind == "mistral":
        return transformers.MistralConfig(**_COMMON, sliding_window=4)
    if kind == "qwen2":
        return transformers.Qwen2Config(
            **_COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1
        )
    if kind == "gemma2":
        return transformers.Gemma2Config(
            **_COMMON, head_dim=16, attn_logit_softcapping=2.0, sliding_window=4, query_pre_attn_scalar=16
        )
    raise ValueError(kind)


def _models(kind: str, other: str = "eager", dtype=torch.float32, device="cpu"):
    """(reference model with attn_implementation=other, the same weights on fa4), in eval mode."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation=other)
    ref = ref.to(device=device, dtype=dtype).eval()
    ours = flash_attn4.patch_transformers(copy.deepcopy(ref))  # set_attn_implementation where it exists
    return ref, ours


def _batch(device="cpu", left=True):
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (3, 12), device=device)
    mask = torch.ones(3, 12, dtype=torch.long, device=device)
    pad = slice(0, 3) if left else slice(9, 12)
    mask[1, pad] = 0
    mask[2, slice(0, 5) if left else slice(7, 12)] = 0
    return ids, mask


CUDA_KERNELS = torch.cuda.is_available() and _build_info.kernel_available("cuda", torch.bfloat16, 16)[0]
DEVICES = [("cpu", torch.float32, 1e-4)] + ([("cuda", torch.bfloat16, 3e-2)] if CUDA_KERNELS else [])
DEVICE_IDS = [d for d, _, _ in DEVICES]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gemma2"])
@pytest.mark.parametrize("left", [True, False], ids=["left_pad", "right_pad"])
@pytest.mark.parametrize("device, dtype, tol", DEVICES, ids=DEVICE_IDS)
def test_padded_logits_match_eager(kind, left, device, dtype, tol):
    if kind in ("qwen2", "gemma2") and _TF_VERSION < (4, 53):
        # Seen with 4.48: its eager path warns "Sliding Window Attention is enabled but not implemented for
        # eager" (Qwen2) and builds Gemma-2's sliding layers differently, so eager is not the reference
        # there; transformers' own flash path honours the window from the kwargs, as we do.
        pytest.skip(f"transformers {transformers.__version__}: eager ignores these models' sliding window")
    ref, ours = _models(kind, dtype=dtype, device=device)
    ids, mask = _batch(device, left)
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits.float()
        b = ours(ids, attention_mask=mask).logits.float()
    assert torch.isfinite(b).all(), "pad rows must stay finite"
    keep = mask.bool()
    torch.testing.assert_close(b[keep], a[keep], atol=tol, rtol=tol)


def test_padded_batch_equals_sequences_one_by_one():
    _, ours = _models("llama")
    ids, mask = _batch(left=True)
    with torch.no_grad():
        batched = ours(ids, attention_mask=mask).logits
        for i in range(ids.shape[0]):
            row = ids[i, mask[i].bool()][None]
            alone = ours(row).logits[0]
            torch.testing.assert_close(batched[i, mask[i].bool()], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_matches_sdpa(kind, cache):
    ref, ours = _models(kind, other="sdpa")
    ids, mask = _batch(left=True)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    if cache == "static":
        kw["cache_implementation"] = "static"
    assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))


@pytest.mark.skipif(_TF_VERSION < (4, 53), reason="mask functions are registered from transformers 4.53")
def test_mask_function_keeps_decoding_free_of_host_syncs():
    """A StaticCache's mask comes back padded to the cache length (one shape at every step, so a compiled
    step is captured once); a decoding step keeps the mask (the decode kernel reads it as lengths, no host
    check); only a long unpadded query block gets None, as transformers' flash mask gives."""
    filled = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    static = hf.mask_function(2, 1, 8, attention_mask=filled)
    assert static.shape == (2, 8) and torch.equal(static[:, :5], filled) and not static[:, 5:].any()
    assert hf._filled_length(static).tolist() == [5, 5]
    ones = torch.ones(2, 300, dtype=torch.long)
    assert hf.mask_function(2, 1, 300, attention_mask=ones).shape == (2, 300)
    assert hf.mask_function(2, 300, 300, attention_mask=ones) is None
    assert hf.mask_function(2, 300, 300, attention_mask=None) is None
    assert hf.mask_function(2, 1, 4, attention_mask=ones).shape == (2, 4)  # a sliding window: the last 4
    # transformers 4.53 .. 4.5x call it with cache_position (one entry per query) instead of q_length.
    assert (
        hf.mask_function(batch_size=2, cache_position=torch.arange(300), kv_length=300, attention_mask=ones)
        is None
    )
    assert (
        hf.mask_function(batch_size=2, cache_position=torch.arange(1), kv_length=300, attention_mask=ones)
        is not None
    )


def test_lengths_and_packing_are_derived_once_per_forward():
    """Every layer gets the same mask / position_ids tensor: the first computes, the others reuse; a tensor
    changed in place (or a new one) is computed afresh."""
    keep = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    lens, leftpad = hf._decode_lengths(keep)
    assert lens.tolist() == [3, 4] and leftpad.tolist() == [1, 0]
    assert hf._decode_lengths(keep)[0] is lens
    keep[0, 0] = True
    assert hf._decode_lengths(keep)[1].tolist() == [0, 0]
    long = torch.zeros(2, 9000, dtype=torch.bool)  # past the cached slot numbers' first size
    long[0, 10:8999] = True
    long[1, :3] = True
    assert [t.tolist() for t in hf._decode_lengths(long)] == [[8999, 3], [10, 0]]
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    cu = hf._packed_offsets(pos, 1, 5)
    assert cu.tolist() == [0, 3, 5] and hf._packed_offsets(pos, 1, 5) is cu
    assert hf._packed_offsets(torch.arange(5)[None], 1, 5) is None


@pytest.mark.parametrize("device, dtype, tol", DEVICES, ids=DEVICE_IDS)
def test_training_step_matches_eager(device, dtype, tol):
    ref, ours = _models("llama", dtype=dtype, device=device)
    ids, mask = _batch(device, left=False)
    losses, grads = [], []
    for model in (ref, ours):
        model.train()
        out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
        losses.append(out.loss.float())
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.float())
    torch.testing.assert_close(losses[1], losses[0], atol=tol, rtol=tol)
    torch.testing.assert_close(grads[1], grads[0], atol=10 * tol, rtol=10 * tol)


def test_packed_sequences_from_position_ids():
    _, ours = _models("llama")
    torch.manual_seed(2)
    a, b = torch.randint(0, 128, (1, 5)), torch.randint(0, 128, (1, 7))
    packed = torch.cat([a, b], dim=1)
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        logits = ours(packed, position_ids=position_ids, use_cache=False).logits[0]
        torch.testing.assert_close(logits[:5], ours(a).logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[5:], ours(b).logits[0], atol=1e-5, rtol=1e-5)


def test_patch_transformers_model_and_global(monkeypatch):
    calls = []
    real = hf.attention_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "attention_forward", counting)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("llama")).eval()
    assert model.config._attn_implementation == "sdpa"
    ids, mask = _batch()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    assert not calls
    assert flash_attn4.patch_transformers(model) is model
    assert model.config._attn_implementation == hf.NAME
    with torch.no_grad():
        after = model(ids, attention_mask=mask).logits
    assert calls
    keep = mask.bool()
    torch.testing.assert_close(after[keep], before[keep], atol=1e-4, rtol=1e-4)

    # Without a model: "sdpa" itself is rerouted until unpatch_transformers().
    calls.clear()
    fresh = transformers.AutoModelForCausalLM.from_config(_config("llama")).eval()
    flash_attn4.patch_transformers()
    try:
        with torch.no_grad():
            fresh(ids, attention_mask=mask)
        assert calls
    finally:
        flash_attn4.unpatch_transformers()
    calls.clear()
    with torch.no_grad():
        fresh(ids, attention_mask=mask)
    assert not calls


def test_dropout_applies_in_training_only_and_bad_masks_are_clear_errors():
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(1, 4, 6, 16)
    k = v = torch.randn(1, 2, 6, 16)
    plain = hf.attention_forward(module, q, k, v, None)[0]
    torch.manual_seed(0)
    dropped = hf.attention_forward(module, q, k, v, None, dropout=0.5)[0]
    torch.manual_seed(0)
    assert torch.equal(hf.attention_forward(module, q, k, v, None, dropout=0.5)[0], dropped)  # reproducible
    assert not torch.allclose(dropped, plain)
    module.eval()  # a module that is not training applies no dropout
    torch.testing.assert_close(hf.attention_forward(module, q, k, v, None, dropout=0.5)[0], plain)
    with pytest.raises(ValueError, match="attention mask"):
        hf.attention_forward(module, q, k, v, torch.ones(6, 6, 6))


def _gpt_oss():
    """A tiny random-weight GPT-OSS (attention sinks on every layer, sliding and full layers, MoE)."""
    cfg = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # sinks large enough to matter
    ours = flash_attn4.patch_transformers(copy.deepcopy(model))
    return model, ours


@pytest.mark.skipif(not hasattr(transformers, "GptOssConfig"), reason="transformers without GPT-OSS")
def test_gpt_oss_sinks_match_eager_forward_and_training_step():
    ref, ours = _gpt_oss()
    ids, mask = _batch(left=True)
    ids = ids % 128
    ref.train(), ours.train()
    out_ref = ref(ids, attention_mask=mask, labels=ids)
    out = ours(ids, attention_mask=mask, labels=ids)
    keep = mask.bool()
    torch.testing.assert_close(out.logits[keep], out_ref.logits[keep], atol=1e-4, rtol=1e-4)
    out_ref.loss.backward()
    out.loss.backward()
    for (name, p_ref), p in zip(ref.named_parameters(), ours.parameters()):
        if p_ref.grad is not None:
            torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-4, rtol=1e-3, msg=name)
    sink_grad = ours.model.layers[0].self_attn.sinks.grad
    assert sink_grad is not None and sink_grad.abs().sum() > 0


def test_compile_fullgraph_no_graph_breaks():
    _, ours = _models("llama")
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        eager = ours(ids, use_cache=False).logits
        compiled = torch.compile(
            lambda x: ours(x, use_cache=False).logits, fullgraph=True, backend="aot_eager"
        )
        torch.testing.assert_close(compiled(ids), eager, atol=1e-5, rtol=1e-5)


def _bert(attention_probs_dropout_prob: float, impl: str = "eager"):
    """A tiny random-weight BertModel (bidirectional encoder, 2-D padding mask)."""
    cfg = transformers.BertConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=attention_probs_dropout_prob,
    )
    torch.manual_seed(0)
    return transformers.BertModel._from_config(cfg, attn_implementation=impl)


def test_bert_with_dropout_trains_reproducibly():
    """BERT's attention dropout in training (padded batch: the packed path): a step runs, the same seed gives
    the same loss and gradients, and the dropout changes the result."""
    model = flash_attn4.patch_transformers(_bert(0.1)).train()
    ids, mask = _batch(left=False)
    keep = mask.bool()
    w = torch.randn(64)  # a readout: LayerNorm makes the mean square of the hidden states 1 whatever they are
    losses, grads = [], []
    for _ in range(2):
        model.zero_grad()
        torch.manual_seed(3)
        loss = (model(ids, attention_mask=mask).last_hidden_state[keep] @ w).square().mean()
        loss.backward()
        losses.append(loss.item())
        grads.append(model.encoder.layer[0].attention.self.query.weight.grad.clone())
    assert losses[0] == losses[1] and torch.equal(grads[0], grads[1]) and torch.isfinite(grads[0]).all()
    with torch.no_grad():
        model.eval()
        plain = (model(ids, attention_mask=mask).last_hidden_state[keep] @ w).square().mean().item()
    assert abs(plain - losses[0]) > 1e-6


@pytest.mark.parametrize("other", ["eager", "sdpa"])
def test_bert_with_dropout_runs_in_eval_mode(other):
    ref = _bert(0.1, other).eval()
    ours = flash_attn4.patch_transformers(copy.deepcopy(ref))
    ids, mask = _batch(left=False)
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).last_hidden_state
        b = ours(ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(b[keep], a[keep], atol=1e-4, rtol=1e-4)


def test_bert_without_dropout_trains_a_step():
    ref = _bert(0.0)
    ours = flash_attn4.patch_transformers(copy.deepcopy(ref))
    ids, mask = _batch(left=False)
    grads = []
    for model in (ref, ours):
        model.train()
        out = model(ids, attention_mask=mask).last_hidden_state
        out[mask.bool()].square().mean().backward()
        grads.append(model.encoder.layer[0].attention.self.query.weight.grad)
    assert torch.isfinite(grads[1]).all() and grads[1].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-4, rtol=1e-4)
    torch.optim.SGD(ours.parameters(), lr=0.1).step()


@pytest.mark.skipif(not hasattr(transformers, "DeepseekV3Config"), reason="transformers without DeepSeek-V3")
def test_deepseek_v3_mla_head_dims_match_eager():
    """MLA: q / k head dim 24 (16 + 8 rotary), v head dim 12; padded batch, forward and a training step."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=128, n_group=1, topk_group=1,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    ours = flash_attn4.patch_transformers(copy.deepcopy(ref))
    ids, mask = _batch(left=True)
    keep = mask.bool()
    outs = [m(ids, attention_mask=mask).logits for m in (ref, ours)]
    torch.testing.assert_close(outs[1][keep], outs[0][keep], atol=1e-4, rtol=1e-4)
    for o in outs:
        o[keep].square().mean().backward()
    for (name, p_ref), p in zip(ref.named_parameters(), ours.parameters()):
        if p_ref.grad is not None:
            torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-4, rtol=1e-3, msg=name)
