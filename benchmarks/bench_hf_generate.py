#!/usr/bin/env python3
"""Generation benchmark: a config-built HuggingFace Llama decoding on flash_attn4 ("fa4") and on transformers'
sdpa, with a DynamicCache and a StaticCache (eager; --compile adds the compiled StaticCache).

    python3 benchmarks/bench_hf_generate.py                   # b1 x 16k and b8 x 4k prompts, 64 new tokens
    python3 benchmarks/bench_hf_generate.py --profile         # where a DynamicCache decode step spends time

Random weights (no downloads), bf16, greedy decoding of exactly --new-tokens tokens after a random prompt.
Both models share one set of weights; they take turns for --rounds rounds (the order alternates), and the
median wall time of `generate` (prefill + decode) is reported with the ratio sdpa / fa4 (> 1: fa4 faster).
Writes benchmarks/results/<gpu>_hf_generate.json unless --no-save.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))
from results_file import default_path, sm_clock_mhz, write_results  # noqa: E402

import flash_attn4  # noqa: E402


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=32000,
        max_position_embeddings=32768,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ours = copy.deepcopy(ref)
    ref.set_attn_implementation("sdpa")
    flash_attn4.patch_transformers(ours)
    return {"sdpa": ref, "fa4": ours}


def generate_s(model, ids, args, cache, compiled) -> tuple[float, torch.Tensor]:
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    if cache == "static":
        kw["cache_implementation"] = "static"
        kw["disable_compile"] = not compiled
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def decode_steps(model, ids, steps: int, profiler=None) -> float:
    """Prefill `ids` into a DynamicCache, then `steps` single-token forwards as generate() makes them (the
    2-D mask grows by one column a step); returns the mean wall time of a step. Steps run under `profiler`
    when one is given."""
    from transformers import DynamicCache

    with torch.no_grad():
        mask = torch.ones_like(ids)
        out = model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config))
        tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = model(input_ids=tok, attention_mask=mask, past_key_values=out.past_key_values)
            tok = out.logits[:, -1:].argmax(-1)
            if profiler is not None:
                profiler.step()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def sync_sites(model, ids, steps: int) -> list[tuple[int, str]]:
    """Where the host waits for the GPU in `steps` decode steps: torch's sync debug mode warns at every
    synchronizing call; each is counted by the innermost Python frames outside torch."""
    import traceback
    import warnings

    sites: dict[str, int] = {}

    def record(*_args, **_kwargs):
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and "warnings" not in f.filename]  # fmt: skip
        key = " <- ".join(reversed(frames[-3:]))
        sites[key] = sites.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            decode_steps(model, ids, steps)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted(((n, k) for k, n in sites.items()), reverse=True)


@contextlib.contextmanager
def decoding_call_times(name: str):
    """Yields a list that collects the host seconds of each decoding call (query length 1) of the attention
    function registered as `name`, while the block runs."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    table = ALL_ATTENTION_FUNCTIONS._global_mapping
    inner, times = table[name], []

    def timed(module, query, *a, **kw):
        t0 = time.perf_counter()
        out = inner(module, query, *a, **kw)
        if query.shape[2] == 1:
            times.append(time.perf_counter() - t0)
        return out

    table[name] = timed
    try:
        yield times
    finally:
        table[name] = inner


def attention_host_us(model, ids, steps: int) -> float:
    """Median host time (us) of one decoding call of the model's attention function over `steps` decode
    steps."""
    with decoding_call_times(model.config._attn_implementation) as times:
        decode_steps(model, ids, steps)
    return statistics.median(times) * 1e6 if times else float("nan")


def profile(models, args) -> None:
    """One DynamicCache decode step of each implementation: wall time per step, where the host waits for
    the GPU, and torch.profiler's top operators by host time and by GPU time (what differs between the two
    is what to look at)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for case in args.cases.split(","):
        b, s = (int(x) for x in case.split("x"))
        ids = torch.randint(0, 32000, (b, s), device="cuda")
        for impl, model in models.items():
            decode_steps(model, ids, 4)  # warm-up
            step_ms = statistics.median(decode_steps(model, ids, 16) for _ in range(3)) * 1e3
            acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with torch_profile(activities=acts, acc_events=True) as prof:
                decode_steps(model, ids, 8)
            table = prof.key_averages()
            print(f"\n=== b{b} prompt {s} {impl}: {step_ms:.3f} ms per decode step (DynamicCache, "
                  f"{args.layers} layers); host waits (prefill + 8 steps):", flush=True)  # fmt: skip
            for n, site in sync_sites(model, ids, 8)[:10]:
                print(f"  {n:4d}  {site}")
            host = attention_host_us(model, ids, 8)
            print(f"  attention function: {host:.1f} us host time per decoding call")
            print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
            print(table.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1x16384,8x4096", help="batch x prompt length, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time the compiled StaticCache")
    ap.add_argument("--out", type=Path, help="result file (default results/<gpu>_hf_generate.json)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--profile", action="store_true", help="profile DynamicCache decode steps, no timing")
    args = ap.parse_args()
    models = build(args)
    if args.profile:
        profile(models, args)
        return
    variants = [("dynamic", False), ("static", False)] + ([("static", True)] if args.compile else [])
    records, clocks = [], []
    for case in args.cases.split(","):
        b, s = (int(x) for x in case.split("x"))
        ids = torch.randint(0, 32000, (b, s), device="cuda")
        for cache, compiled in variants:
            name = cache + (" compiled" if compiled else "")
            times = {impl: [] for impl in models}
            outs = {}
            for r in range(args.rounds + 1):  # round 0 warms up (and compiles)
                for impl in list(models)[:: 1 if r % 2 else -1]:
                    t, outs[impl] = generate_s(models[impl], ids, args, cache, compiled)
                    if r:
                        times[impl].append(t)
                        clocks.append(sm_clock_mhz())
            same = (outs["fa4"][:, s:] == outs["sdpa"][:, s:]).float().mean().item()
            med = {impl: statistics.median(ts) for impl, ts in times.items()}
            ratio = med["sdpa"] / med["fa4"]
            print(f"b{b} prompt {s} {name:16s}: sdpa {med['sdpa']:.3f} s  fa4 {med['fa4']:.3f} s  "
                  f"sdpa/fa4 {ratio:.3f}  (same tokens: {same:.0%})", flush=True)  # fmt: skip
            for impl, ts in times.items():
                records.append(dict(impl="flash_attn4" if impl == "fa4" else "hf_sdpa", batch=b, seqlen=s,
                                    cache=name, new_tokens=args.new_tokens, layers=args.layers,
                                    hidden=args.hidden, nheads=args.heads, nheads_kv=args.kv_heads,
                                    hdim=args.hidden // args.heads, dtype="bf16", causal=True, s=med[impl],
                                    s_rounds=ts, same_tokens=same))  # fmt: skip
    if not args.no_save:
        import transformers

        path = args.out or default_path("hf_generate")
        print(f"wrote {write_results(records, path, clocks, transformers=transformers.__version__)}")


if __name__ == "__main__":
    main()
