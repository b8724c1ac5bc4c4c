"""Speculative decoding: acceptance rate and speed over plain decoding, side by side in one run.

Target: the ~102M Qwen2-shaped benchmark model (common.BENCH_DTYPE, CPU). Drafts: the target itself (acceptance must be
100%), and a 2-layer model of the same width and vocabulary. Greedy, 8 prompts of 32 tokens, 64 new tokens.
Random weights mean a separate draft agrees with the target only by chance: that row shows the cost of
speculation when drafts are rejected, the draft = target row its upper bound on acceptance.

    python bench/bench_speculative.py [--reps 2] [--k 4] [--num-prompts 8] [--new-tokens 64] [--quick]
"""

from __future__ import annotations

import argparse
import statistics

from common import (
    BENCH_DTYPE,
    BENCH_MODEL_SPEC,
    BENCH_VOCAB,
    bench_model_path,
    environment,
    parse_args,
    random_prompts,
    save,
    timed,
)
from llminfer import CacheConfig, EngineConfig, InferenceEngine
from llminfer.logging import configure_logging
from llminfer.models import build_random_model, default_cache_dir


def draft_path():
    dest = default_cache_dir() / "bench-qwen2-draft-2layer-v1"
    if not (dest / "config.json").exists():
        build_random_model(dest, **{**BENCH_MODEL_SPEC, "num_layers": 2, "seed": 1})
    return dest


def engine(path, draft=None, k=4):
    cfg = EngineConfig(model_name=str(path), dtype=BENCH_DTYPE, device="cpu", max_batch_size=8, batch_timeout_ms=0,
                       cache=CacheConfig(page_size_tokens=16, kv_cache_memory_bytes=256 << 20),
                       assistant_model_name=str(draft) if draft else None, speculative_num_assistant_tokens=k,
                       speculative_confidence_threshold=0.0)
    return InferenceEngine(cfg).load().start()


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = parse_args(ap, {"reps": 1, "num_prompts": 4, "new_tokens": 8})
    configure_logging("warning")
    target = bench_model_path()
    prompts = random_prompts(args.num_prompts, 32, BENCH_VOCAB, seed=4)
    engines = {"plain": engine(target), "draft=target": engine(target, target, args.k),
               "draft=2-layer": engine(target, draft_path(), args.k)}
    kw = dict(max_new_tokens=args.new_tokens, ignore_eos=True)
    for e in engines.values():
        e.run_batch_continuous(prompts[:2], max_new_tokens=4)  # warm-up
    times = {k: [] for k in engines}
    outputs = {}
    rates = {}
    for _ in range(args.reps):
        for name, e in engines.items():
            t, res = timed(e.run_batch_continuous, prompts, **kw)
            times[name].append(t)
            outputs[name] = [r.token_ids for r in res]
            prop = sum(r.stats.spec_proposed_tokens for r in res)
            rates[name] = sum(r.stats.spec_accepted_tokens for r in res) / prop if prop else None
    for e in engines.values():
        e.close()
    tps = {k: args.num_prompts * args.new_tokens / statistics.median(v) for k, v in times.items()}
    payload = {
        "benchmark": "speculative_decoding", "k": args.k, "output_tokens_per_s": tps,
        "speed_ratio_vs_plain": {k: v / tps["plain"] for k, v in tps.items()},
        "acceptance_rate": rates,
        "greedy_identical": {k: outputs[k] == outputs["plain"] for k in outputs},
        "environment": environment(),
    }
    for name in engines:
        acc = rates[name]
        print(f"[speculative] {name:14s} {tps[name]:7.1f} tok/s  x{payload['speed_ratio_vs_plain'][name]:.2f} "
              f"acceptance {'-' if acc is None else f'{acc:.0%}'}  identical={payload['greedy_identical'][name]}")
    print(f"-> {save('speculative', payload)}")
    return payload


if __name__ == "__main__":
    main()
