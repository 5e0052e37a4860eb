"""Switch a HuggingFace model to flash_attn4, train a step, generate.

    python3 examples/hf_llama.py            # CUDA (bf16, the kernels) when available, else CPU (reference)

A tiny random-weight Llama from a config keeps it download-free; with a real checkpoint it is the same:
`flash_attn4.integrations.hf.register()`, then `AutoModelForCausalLM.from_pretrained(name,
attn_implementation="fa4")`; or `flash_attn4.patch_transformers(model)` on a model you already have.
"""

import torch
import transformers

import flash_attn4

device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
config = transformers.LlamaConfig(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)

flash_attn4.patch_transformers(model)  # the one line
print("attention implementation:", model.config._attn_implementation)

# A training step on a padded batch (right padding; pad labels ignored).
ids = torch.randint(0, config.vocab_size, (2, 64), device=device)
mask = torch.ones_like(ids)
mask[1, 40:] = 0
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
loss.backward()
opt.step()
print(f"training step: loss {loss.item():.4f}")

# Greedy generation from a left-padded batch.
model.eval()
prompt = torch.randint(0, config.vocab_size, (2, 16), device=device)
prompt_mask = torch.ones_like(prompt)
prompt_mask[0, :4] = 0
out = model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=8, do_sample=False)
print("generated:", out[:, 16:].tolist())
