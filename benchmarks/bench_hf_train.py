"""Training-step benchmark of a HuggingFace Llama on flash_attn4 ("fa4") against transformers' sdpa.

    python3 benchmarks/bench_hf_train.py                      # hidden 2048, 16 heads, 4 layers, seqlen 4096
    python3 benchmarks/bench_hf_train.py --batch 2 --steps 10 --out benchmarks/results/h200_hf_train.json

Random weights from a config (no downloads), bf16, one batch of random tokens (no padding), AdamW. Both
implementations start from the same weights; the first step's loss is compared (it sees identical
weights), then the median step time gives tokens/s. The two models take turns for --rounds rounds of --steps
steps (the first round after --warmup steps each; the order alternates per round), so that clock and
thermal drift over the run land on both alike; the per-round ratios show the spread.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
from results_file import sm_clock_mhz, write_results  # benchmarks/ is on sys.path when run as a script


class Trainer:
    """One model with its optimizer; run() times training steps with CUDA events."""

    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.first_loss: float | None = None

    def run(self, ids, steps: int, warmup: int = 0) -> list[float]:
        """Per-step milliseconds of `steps` steps after `warmup` untimed ones."""
        times = []
        for i in range(warmup + steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = self.model(ids, labels=ids).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            end.record()
            end.synchronize()
            if self.first_loss is None:
                self.first_loss = loss.item()
            if i >= warmup:
                times.append(start.elapsed_time(end))
        return times


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
    ap.add_argument("--rounds", type=int, default=3, help="turns each model takes (order alternates)")
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
    impls = ("sdpa", hf.NAME)
    trainers = {}
    for impl in impls:
        model = copy.deepcopy(base)
        model.set_attn_implementation(impl)
        model.train()
        trainers[impl] = Trainer(model)
    times, clocks = {impl: [] for impl in impls}, []
    for r in range(args.rounds):
        order = impls if r % 2 == 0 else impls[::-1]
        round_ms = {}
        for impl in order:
            t = trainers[impl].run(ids, args.steps, args.warmup if r == 0 else 0)
            times[impl] += t
            round_ms[impl] = statistics.median(t)
            clocks.append(sm_clock_mhz())
        print(
            f"round {r + 1}/{args.rounds}: "
            + "  ".join(f"{impl} {round_ms[impl]:.2f} ms" for impl in impls)
            + f"  fa4/sdpa {round_ms[impls[0]] / round_ms[impls[1]]:.3f}x tokens/s",
            flush=True,
        )
    records = []
    for impl in impls:
        ms = statistics.median(times[impl])
        rec = {
            "impl": impl,
            "loss_first_step": trainers[impl].first_loss,
            "step_ms": ms,
            "tokens_per_s": args.batch * args.seqlen / (ms * 1e-3),
            **{k: getattr(args, k) for k in ("hidden", "heads", "layers", "seqlen", "batch", "steps")},
            "rounds": args.rounds,
        }
        records.append(rec)
        if args.profile:
            profile_step(trainers[impl].model, ids)
        loss = rec["loss_first_step"]
        print(f"{impl:>5}: loss {loss:.5f}  step {ms:.1f} ms  {rec['tokens_per_s']:.0f} tokens/s", flush=True)
    sdpa, ours = records
    print(
        f"fa4 / sdpa: {ours['tokens_per_s'] / sdpa['tokens_per_s']:.3f}x tokens/s, "
        f"loss difference {abs(ours['loss_first_step'] - sdpa['loss_first_step']):.2e}"
    )
    if args.out:
        write_results(records, args.out, clocks, transformers=transformers.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
