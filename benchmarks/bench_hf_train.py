"""Training-step benchmark of a HuggingFace Llama on flash_attn4 ("fa4") against transformers' sdpa.

    python3 benchmarks/bench_hf_train.py                      # hidden 2048, 16 heads, 4 layers, seqlen 4096
    python3 benchmarks/bench_hf_train.py --batch 2 --steps 10 --out benchmarks/results/h200_hf_train.json

Random weights from a config (no downloads), bf16, one batch of random tokens (no padding), AdamW. Both
implementations start from the same weights; the first step's loss is compared (it sees identical
weights), then the median step time over --steps steps (after --warmup) gives tokens/s.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch


def step_times(model, ids, steps: int, warmup: int) -> tuple[float, list[float]]:
    """(loss of the first step, per-step milliseconds after warmup)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    first_loss, times = None, []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        if first_loss is None:
            first_loss = loss.item()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return first_loss, times


def profile_step(model, ids, rows: int = 25) -> None:
    """Prints the CUDA kernels of one training step, most time first (where an implementation spends)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    table = prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60
    )
    print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, help="JSON file for the two records")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one step")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_hf_train.py needs a CUDA device", file=sys.stderr)
        return 1
    import transformers

    from flash_attn4.integrations import hf

    hf.register()
    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seqlen,
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seqlen), device="cuda")
    records = []
    for impl in ("sdpa", hf.NAME):
        model = copy.deepcopy(base)
        model.set_attn_implementation(impl)
        model.train()
        loss, times = step_times(model, ids, args.steps, args.warmup)
        ms = statistics.median(times)
        rec = {
            "impl": impl,
            "loss_first_step": loss,
            "step_ms": ms,
            "tokens_per_s": args.batch * args.seqlen / (ms * 1e-3),
            **{k: getattr(args, k) for k in ("hidden", "heads", "layers", "seqlen", "batch", "steps")},
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        records.append(rec)
        if args.profile:
            profile_step(model, ids)
        print(f"{impl:>5}: loss {loss:.5f}  step {ms:.1f} ms  {rec['tokens_per_s']:.0f} tokens/s", flush=True)
        del model
        torch.cuda.empty_cache()
    sdpa, ours = records
    print(
        f"fa4 / sdpa: {ours['tokens_per_s'] / sdpa['tokens_per_s']:.3f}x tokens/s, "
        f"loss difference {abs(ours['loss_first_step'] - sdpa['loss_first_step']):.2e}"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
