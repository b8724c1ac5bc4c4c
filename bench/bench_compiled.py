"""Compiled backend (``torch.compile``, inductor) over the eager backend: output tokens/s, side by side.

Model: the ~102M Qwen2-shaped benchmark model (common.BENCH_DTYPE, CPU). Greedy, prompts of 32 tokens, ``--new-tokens``
new tokens (ignore_eos), at batch 1, 8 and 32 (all requests submitted at once to the continuous-batching
scheduler). Both engines are warmed up on the same workload first; the compiled one compiles each token
bucket it meets there (the warm-up time and the compile count are reported). The timed runs alternate
eager / compiled per repetition, and the compile count must not grow during them (``recompiles``).

    python bench/bench_compiled.py [--reps 2] [--new-tokens 64] [--batches 1,32] [--mode default]
        [--model bench|builtin] [--quick]

``--quick`` runs the built-in tiny model: it checks the suite end to end; its ratio is not a figure.
"""

from __future__ import annotations

import argparse
import statistics
import time

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
from llminfer import Backend, CacheConfig, EngineConfig, InferenceEngine, SchedulerConfig
from llminfer.logging import configure_logging
from llminfer.models import builtin_model_path


def engine(path, backend: Backend, max_batch: int, mode: str) -> InferenceEngine:
    cfg = EngineConfig(model_name=str(path), backend=backend, dtype=BENCH_DTYPE, device="cpu",
                       max_batch_size=max_batch, batch_timeout_ms=20, compile_mode=mode,
                       cache=CacheConfig(page_size_tokens=16, kv_cache_memory_bytes=512 << 20),
                       scheduler=SchedulerConfig(max_num_batched_tokens=2048))
    return InferenceEngine(cfg).load().start()


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--mode", default="default", choices=["default", "reduce-overhead", "max-autotune"])
    ap.add_argument("--model", default="bench", choices=["bench", "builtin"],
                    help="the ~102M bench model, or the built-in tiny model (--quick: compiling the bench "
                    "model from a cold inductor cache takes ~50 s on 2 cores)")
    args = parse_args(ap, {"reps": 1, "new_tokens": 8, "batches": "1", "model": "builtin"})  # compiling dominates
    configure_logging("warning")
    path = bench_model_path() if args.model == "bench" else builtin_model_path()
    batches = [int(b) for b in args.batches.split(",")]
    max_batch = max(batches)
    eager = engine(path, Backend.EAGER, max_batch, args.mode)
    compiled = engine(path, Backend.COMPILED, max_batch, args.mode)
    kw = dict(max_new_tokens=args.new_tokens, ignore_eos=True)
    results: dict[str, dict] = {}
    for batch in batches:
        # Fresh random prompts for every run (no prefix-cache hits anywhere); same prompts for both engines.
        warm = random_prompts(batch, args.prompt_tokens, BENCH_VOCAB, seed=10_000 + batch)
        t0 = time.perf_counter()
        eager.run_batch_continuous(warm, **kw)
        eager_warm = time.perf_counter() - t0
        compiles_before = compiled.backend.num_compiles
        t0 = time.perf_counter()
        compiled.run_batch_continuous(warm, **kw)
        compiled_warm = time.perf_counter() - t0
        compiles_after_warmup = compiled.backend.num_compiles
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        same = total = 0
        for rep in range(args.reps):
            prompts = random_prompts(batch, args.prompt_tokens, BENCH_VOCAB, seed=20_000 + 100 * batch + rep)
            order = (("eager", eager), ("compiled", compiled))
            outs = {}
            for name, e in order if rep % 2 == 0 else order[::-1]:
                t, res = timed(e.run_batch_continuous, prompts, **kw)
                times[name].append(t)
                outs[name] = [r.token_ids for r in res]
            same += sum(a == b for a, b in zip(outs["eager"], outs["compiled"]))
            total += batch
        tokens = batch * args.new_tokens
        tps = {k: tokens / statistics.median(v) for k, v in times.items()}
        results[f"batch_{batch}"] = {
            "batch": batch,
            "output_tokens_per_s": tps,
            "speed_ratio_compiled_over_eager": tps["compiled"] / tps["eager"],
            "seconds": times,
            "warmup_s": {"eager": eager_warm, "compiled": compiled_warm},
            "compiles_during_warmup": compiles_after_warmup - compiles_before,
            "recompiles_during_timed_runs": compiled.backend.num_compiles - compiles_after_warmup,
            "greedy_identical_sequences": f"{same}/{total}",
        }
        r = results[f"batch_{batch}"]
        print(f"[compiled] batch {batch:3d}: eager {tps['eager']:7.1f} tok/s | compiled {tps['compiled']:7.1f} tok/s"
              f" | x{r['speed_ratio_compiled_over_eager']:.2f} | warm-up {compiled_warm:.1f} s "
              f"({r['compiles_during_warmup']} compiles) | recompiles {r['recompiles_during_timed_runs']} | "
              f"identical {r['greedy_identical_sequences']}", flush=True)
    stats = compiled.backend.stats()
    eager.close()
    compiled.close()
    payload = {
        "benchmark": "compiled_vs_eager",
        "model": f"{'bench-qwen2-102m' if args.model == 'bench' else 'builtin tiny'} ({BENCH_DTYPE}, cpu)",
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "compile_mode": args.mode,
        "results": results,
        "compiled_backend": stats,
        "environment": environment(),
    }
    print(f"-> {save('compiled_vs_eager', payload)}")
    return payload


if __name__ == "__main__":
    main()
