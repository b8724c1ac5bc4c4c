"""Served vs in-process throughput: 32 concurrent streaming clients against `llminfer serve` (its own
process) over the same requests run in-process through the engine, measured one after the other in one run.

    python bench/bench_serving.py [--num-requests 64] [--concurrency 32] [--max-tokens 64] [--quick]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import httpx

from common import BENCH_DTYPE, bench_model_path, environment, parse_args, save, timed
from llminfer import CacheConfig, EngineConfig, InferenceEngine
from llminfer.benchmark.serving import ServingConfig, ServingWorkload, run_serving_benchmark_sync
from llminfer.logging import configure_logging


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = parse_args(ap, {"num_requests": 8, "concurrency": 8, "max_tokens": 8})
    configure_logging("warning")
    path = bench_model_path()
    workload = ServingWorkload(num_requests=args.num_requests, prompt_len=(16, 64),
                               output_len=(args.max_tokens, args.max_tokens), seed=3)
    requests = workload.requests()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen([sys.executable, "-m", "llminfer.cli", "serve", "--model", str(path), "--dtype",
                               BENCH_DTYPE, "--device", "cpu", "--max-batch-size", str(args.concurrency), "--port",
                               str(port), "--log-level", "warning"], stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        cfg = ServingConfig(base_url=base, concurrency=args.concurrency, extra_body={"ignore_eos": True,
                                                                                     "temperature": 0})
        run_serving_benchmark_sync(cfg, ServingWorkload(num_requests=4, output_len=(4, 4), seed=9))  # warm-up
        served = run_serving_benchmark_sync(cfg, workload)
    finally:
        server.terminate()
        server.wait(60)

    engine = InferenceEngine(EngineConfig(model_name=str(path), dtype=BENCH_DTYPE, device="cpu",
                                          max_batch_size=args.concurrency,
                                          cache=CacheConfig(kv_cache_memory_bytes=1 << 30))).load().start()
    engine.run_batch_continuous(["warm up"] * 4, max_new_tokens=4)
    engine.reset_prefix_cache()
    reqs = [engine.make_request(p, max_new_tokens=n, ignore_eos=True) for p, n in requests]
    seconds, results = timed(engine.run_requests, reqs)
    engine.close()
    in_process = sum(r.stats.completion_tokens for r in results) / seconds
    s = served.summary
    payload = {"benchmark": "served_vs_in_process", "num_requests": args.num_requests,
               "concurrency": args.concurrency, "max_tokens": args.max_tokens,
               "served_output_tokens_per_s": s["output_tokens_per_s"], "in_process_output_tokens_per_s": in_process,
               "ratio_served_over_in_process": s["output_tokens_per_s"] / in_process,
               "served_failed": s["failed"], "served_ttft_ms_p50": s["ttft_ms_p50"], "environment": environment()}
    print(f"[serving] served {s['output_tokens_per_s']:.1f} tok/s ({s['failed']} failed), in-process "
          f"{in_process:.1f} tok/s, ratio {payload['ratio_served_over_in_process']:.2f}")
    print(f"-> {save('serving', payload)}")
    return payload


if __name__ == "__main__":
    main()
