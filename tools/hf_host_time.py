"""Host time of the HF attention function on a decoding step, with the kernels stubbed out (no GPU needed).

    python3 tools/hf_host_time.py                 # batch 1, 8 layers, 200 new tokens
    python3 tools/hf_host_time.py --batch 8

A decoding step of a small model is host-bound, so the Python and dispatch work around the kernels decides
its speed. This runs `generate` on the CPU with a config-built Llama (bf16, GQA 16 / 4 heads, head dim 16)
on "fa4" and on transformers' "sdpa", with every kernel replaced by an empty output: our decode op's
implementation (`_ops_kvcache.fwd_kvcache_impl`, with `_ops.eager_direct` saying yes, as for CUDA tensors)
and `scaled_dot_product_attention`. The registered attention function is timed on each call with one query
token; prints the median a call for each, over --runs runs, alternating.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flash_attn4 import _ops, _ops_kvcache  # noqa: E402
from flash_attn4.integrations import hf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_hf_generate import decoding_call_times  # noqa: E402


def stub_kernels() -> None:
    def decode_op(q, *args):
        b, sq, hq, d = q.shape
        return q.new_empty(b, sq, hq, d), torch.empty(b, hq, sq, dtype=torch.float32)

    _ops.eager_direct = lambda *tensors: True
    _ops_kvcache.fwd_kvcache_impl = decode_op
    torch.nn.functional.scaled_dot_product_attention = lambda q, k, v, **kw: torch.empty_like(q)


def host_us(name: str, args) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=args.layers,
                      num_attention_heads=16, num_key_value_heads=4, vocab_size=1000)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.set_attn_implementation(name)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, 64))
    with decoding_call_times(name) as times, torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False)  # fmt: skip
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    stub_kernels()
    hf.register()
    results = {"fa4": [], "sdpa": []}
    for r in range(args.runs):
        for name in list(results)[:: 1 if r % 2 == 0 else -1]:
            results[name].append(host_us(name, args))
    for name, us in results.items():
        print(f"{name}: {statistics.median(us):.1f} us a decoding call (runs: "
              + ", ".join(f"{u:.1f}" for u in us) + ")")  # fmt: skip


if __name__ == "__main__":
    main()
