"""Step metadata built with tensor ops vs the Python per-token loop, side by side in one run (CPU).

Two figures, each alternating "before" (:func:`llminfer.backends.attention.build_metadata_loop`) and
"after" (:func:`llminfer.backends.attention.build_metadata`) in the same process:

* ``builder``: the metadata build alone, for three step shapes (32 decode rows at ~1k context; one
  2048-token prefill chunk over a 1k cached prefix; a mixed step of 24 decode rows and two 512-token chunks);
* ``step``: the eager engine's mean step time on the ~100M bench model (32 requests, 256-token prompts,
  32 output tokens, ignore EOS), the engine's builder swapped for the loop in the "before" runs.

    python bench/bench_step_metadata.py [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import (
    BENCH_DTYPE,
    BENCH_TORCH_DTYPE,
    BENCH_VOCAB,
    bench_model_path,
    environment,
    random_prompts,
    save,
)
from llminfer import CacheConfig, EngineConfig, InferenceEngine
from llminfer.backends import hf as hf_backend
from llminfer.backends.attention import PagedKVCache, build_metadata, build_metadata_loop
from llminfer.logging import configure_logging

BLOCK = 16


def _shapes() -> dict[str, tuple[list[int], list[int], list[list[int]]]]:
    def tables(starts, lengths):
        out, nxt = [], 0
        for s, n in zip(starts, lengths):
            need = -(-(s + n) // BLOCK)
            out.append(list(range(nxt, nxt + need)))
            nxt += need
        return out

    shapes = {}
    starts, lengths = [1000 + 7 * i for i in range(32)], [1] * 32
    shapes["decode_32x1k"] = (starts, lengths, tables(starts, lengths))
    starts, lengths = [1024], [2048]
    shapes["prefill_2048_over_1k"] = (starts, lengths, tables(starts, lengths))
    starts, lengths = [800 + 5 * i for i in range(24)] + [0, 512], [1] * 24 + [512, 512]
    shapes["mixed_24_decode_2x512"] = (starts, lengths, tables(starts, lengths))
    return shapes


def bench_builder(reps: int, iters: int) -> dict:
    cache = PagedKVCache(1, 8192, BLOCK, 2, 64, BENCH_TORCH_DTYPE, "cpu")
    out = {}
    for name, (starts, lengths, tabs) in _shapes().items():
        times = {"before": [], "after": []}
        for _ in range(reps):
            for label, fn in (("before", build_metadata_loop), ("after", build_metadata)):
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn(cache, starts, lengths, tabs, "cpu")
                times[label].append((time.perf_counter() - t0) / iters * 1e3)
        before, after = statistics.median(times["before"]), statistics.median(times["after"])
        out[name] = {"ms_before": before, "ms_after": after, "ratio_after_over_before": after / before}
        print(f"[metadata] {name}: loop {before:.3f} ms, tensor ops {after:.3f} ms, after/before {after / before:.3f}")
    return out


def _loop_builder(cache, starts, lengths, tables, device, attention_backend="torch", **_):
    return build_metadata_loop(cache, starts, lengths, tables, device)


def bench_step(reps: int, num_requests: int, prompt_len: int = 256, new_tokens: int = 32) -> dict:
    cfg = EngineConfig(model_name=str(bench_model_path()), dtype=BENCH_DTYPE, device="cpu", max_batch_size=32,
                       batch_timeout_ms=0, attention_backend="torch",
                       cache=CacheConfig(page_size_tokens=BLOCK, kv_cache_memory_bytes=512 << 20))
    engine = InferenceEngine(cfg).load().start()
    backend = engine.backend
    engine.run_batch_continuous(random_prompts(4, 16, BENCH_VOCAB, seed=99), max_new_tokens=4)
    times = {"before": [], "after": []}
    seed = 0
    try:
        for _ in range(reps):
            for label, builder in (("before", _loop_builder), ("after", build_metadata)):
                hf_backend.build_metadata = builder
                seed += 1
                prompts = random_prompts(num_requests, prompt_len, BENCH_VOCAB, seed=seed)
                steps0 = backend.num_steps
                t0 = time.perf_counter()
                engine.run_batch_continuous(prompts, max_new_tokens=new_tokens, ignore_eos=True)
                times[label].append((time.perf_counter() - t0) / (backend.num_steps - steps0) * 1e3)
    finally:
        hf_backend.build_metadata = build_metadata
        engine.close()
    before, after = statistics.median(times["before"]), statistics.median(times["after"])
    print(f"[metadata] engine step: loop {before:.2f} ms, tensor ops {after:.2f} ms, after/before {after / before:.3f}")
    return {"ms_per_step_before": before, "ms_per_step_after": after, "ratio_after_over_before": after / before,
            "ms_per_step_runs": times, "num_requests": num_requests}


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer builder iterations and requests")
    args = ap.parse_args()
    configure_logging("warning")
    torch.set_num_threads(2)
    payload = {"benchmark": "step_metadata", "builder": bench_builder(args.reps, 20 if args.quick else 100),
               "step": bench_step(args.reps, *((8, 64, 16) if args.quick else (32, 256, 32))),
               "environment": environment()}
    print(f"-> {save('step_metadata', payload)}")
    return payload


if __name__ == "__main__":
    main()
