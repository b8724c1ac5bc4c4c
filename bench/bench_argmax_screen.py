"""The argmax screen (``EngineConfig.cpu_argmax_screen``) on and off: greedy output tokens/s, side by side.

Model: the ~102M Qwen2-shaped benchmark model in float32 (the screen is for fp32 heads), CPU, whose LM head
(151,646 x 512) is most of a decode step. Greedy, prompts of 32 random tokens, ``--new-tokens`` new tokens (ignore_eos), at batch 1, 8
and 32 (continuous batching). Two engines of one backend, the screen off and on; the timed runs alternate
between them per repetition, on the same prompts, and every sequence's tokens are compared. The screen's
load-time probe (ms for one row, fp32 head against the screen) and its mean candidates per row are reported.

    python bench/bench_argmax_screen.py [--reps 3] [--new-tokens 64] [--batches 1,8,32] [--backend eager]
        [--quick]

``--quick`` runs batch 1 with 8 tokens: it checks the suite end to end; its ratio is not a figure.
"""

from __future__ import annotations

import argparse
import statistics

from common import (
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


def engine(backend: Backend, max_batch: int, screen: bool) -> InferenceEngine:
    cfg = EngineConfig(model_name=str(bench_model_path()), backend=backend, dtype="float32", device="cpu",
                       max_batch_size=max_batch, batch_timeout_ms=20, cpu_argmax_screen=screen,
                       cache=CacheConfig(page_size_tokens=16, kv_cache_memory_bytes=512 << 20),
                       scheduler=SchedulerConfig(max_num_batched_tokens=2048))
    return InferenceEngine(cfg).load().start()


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--backend", default="eager", choices=["eager", "compiled"])
    args = parse_args(ap, {"reps": 1, "new_tokens": 8, "batches": "1"})
    configure_logging("warning")
    batches = [int(b) for b in args.batches.split(",")]
    engines = {name: engine(Backend(args.backend), max(batches), name == "on") for name in ("off", "on")}
    kw = dict(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=0.0)
    results: dict[str, dict] = {}
    for batch in batches:
        warm = random_prompts(batch, args.prompt_tokens, BENCH_VOCAB, seed=10_000 + batch)
        for e in engines.values():
            e.run_batch_continuous(warm, **kw)  # compiles (compiled backend) and packs outside the timed runs
        times: dict[str, list[float]] = {"off": [], "on": []}
        same = total = 0
        for rep in range(args.reps):
            prompts = random_prompts(batch, args.prompt_tokens, BENCH_VOCAB, seed=20_000 + 100 * batch + rep)
            outs = {}
            for name in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                t, res = timed(engines[name].run_batch_continuous, prompts, **kw)
                times[name].append(t)
                outs[name] = [r.token_ids for r in res]
            same += sum(a == b for a, b in zip(outs["off"], outs["on"]))
            total += batch
        tps = {k: batch * args.new_tokens / statistics.median(v) for k, v in times.items()}
        results[f"batch_{batch}"] = {"batch": batch, "output_tokens_per_s": tps, "speed_ratio_on_over_off":
                                     tps["on"] / tps["off"], "seconds": times,
                                     "greedy_identical_sequences": f"{same}/{total}"}
        print(f"[argmax_screen] batch {batch:3d}: off {tps['off']:7.1f} tok/s | on {tps['on']:7.1f} tok/s | "
              f"x{tps['on'] / tps['off']:.2f} | identical {same}/{total}", flush=True)
    screen = engines["on"].backend.describe()["argmax_screen"]
    for e in engines.values():
        e.close()
    print(f"[argmax_screen] screen: {screen}")
    payload = {"benchmark": "argmax_screen", "model": "bench-qwen2-102m (float32, cpu)",
               "backend": args.backend, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "results": results, "screen": screen, "environment": environment()}
    print(f"-> {save('argmax_screen', payload)}")
    return payload


if __name__ == "__main__":
    main()
