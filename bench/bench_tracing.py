"""Tracing overhead: throughput with stage tracing on over off, same prompts, alternating runs.

    python bench/bench_tracing.py [--reps 3] [--batch 32] [--new-tokens 32] [--quick]
"""

from __future__ import annotations

import argparse
import statistics

from common import (
    BENCH_DTYPE,
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


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = parse_args(ap, {"reps": 2, "batch": 8, "new_tokens": 8})
    configure_logging("warning")
    path = bench_model_path()
    engines = {}
    for tracing in (False, True):
        cfg = EngineConfig(model_name=str(path), dtype=BENCH_DTYPE, device="cpu", max_batch_size=32,
                           batch_timeout_ms=0, enable_tracing=tracing,
                           cache=CacheConfig(page_size_tokens=16, kv_cache_memory_bytes=512 << 20))
        engines["on" if tracing else "off"] = InferenceEngine(cfg).load().start()
    times = {"on": [], "off": []}
    seed = 0
    for e in engines.values():
        e.run_batch_continuous(random_prompts(4, 16, BENCH_VOCAB, seed=99), max_new_tokens=4)
    for _ in range(args.reps):
        for name, e in engines.items():
            seed += 1
            prompts = random_prompts(args.batch, 32, BENCH_VOCAB, seed=seed)
            t, _ = timed(e.run_batch_continuous, prompts, max_new_tokens=args.new_tokens, ignore_eos=True)
            times[name].append(t)
            e.tracer.clear()
    for e in engines.values():
        e.close()
    tps = {k: args.batch * args.new_tokens / statistics.median(v) for k, v in times.items()}
    payload = {"benchmark": "tracing_overhead", "output_tokens_per_s": tps, "seconds": times,
               "ratio_on_over_off": tps["on"] / tps["off"], "environment": environment()}
    print(f"[tracing] tok/s off {tps['off']:.1f}, on {tps['on']:.1f}; on/off = {payload['ratio_on_over_off']:.3f}")
    print(f"-> {save('tracing', payload)}")
    return payload


if __name__ == "__main__":
    main()
