"""The end-to-end tour: eager run, quantized load, streaming, batch, prefix-cache reuse, a small
benchmark and a backend comparison.

Runs offline on the built-in tiny model (random weights: the text is meaningless by design):

    python examples/full_demo.py [--model Qwen/Qwen2.5-0.5B-Instruct] [--max-new-tokens 16]

With a real model (for example Qwen/Qwen2.5-0.5B-Instruct) the same script prints readable text.
"""

from __future__ import annotations

import argparse
import tempfile

from llminfer import (
    BackendUnavailableError,
    EngineConfig,
    InferenceEngine,
    QuantConfig,
    QuantMode,
)
from llminfer.benchmark import BackendComparison, Benchmarker


def section(title: str) -> None:
    print(f"\n=== {title}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model id or folder (default: the built-in model)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    n = args.max_new_tokens
    summary: dict = {}

    section("eager run")
    engine = InferenceEngine(EngineConfig(model_name=args.model, max_batch_size=8)).load().start()
    result = engine.run("The capital of France is", max_new_tokens=n)
    print(repr(result.generated_text))
    print(f"TTFT {result.stats.ttft_ms:.1f} ms, {result.stats.throughput_tokens_per_sec:.1f} tok/s")
    summary["run_tokens"] = result.stats.completion_tokens

    section("streaming")
    pieces = []
    for chunk in engine.stream("Streaming works like this:", max_new_tokens=n):
        if not chunk.is_final:  # all text is on the non-final chunks
            print(chunk.token, end="", flush=True)
            pieces.append(chunk.token)
        else:  # the final chunk: no text, the finish reason and the stats
            print(f"\n{len(pieces)} chunks [{chunk.finish_reason}, {chunk.stats.completion_tokens} tokens]")
    summary["stream_chunks"] = len(pieces)

    section("batch (continuous batching)")
    batch = engine.run_batch_continuous([f"Question {i}: why is the sky blue?" for i in range(6)], max_new_tokens=n)
    print(f"{len(batch)} results, {sum(r.stats.completion_tokens for r in batch)} tokens")
    summary["batch"] = len(batch)

    section("prefix-cache reuse")
    system = "You are a helpful assistant who answers in one short sentence. " * 4
    engine.run(system + "What is a KV cache?", max_new_tokens=4)
    hit = engine.run(system + "What is paged attention?", max_new_tokens=4)
    print(f"cache hit: {hit.stats.cache_hit}, cached tokens: {hit.stats.cached_tokens}")
    print("cache stats:", engine.cache_stats())
    summary["cache_hit"] = hit.stats.cache_hit

    section("a small benchmark")
    bench = Benchmarker(engine, prompt_len=16).run(batch_sizes=[1, 4], num_runs=1, max_new_tokens=n)
    bench.print_summary()
    engine.close()

    section("quantized load (bitsandbytes INT8)")
    try:
        qengine = InferenceEngine(EngineConfig(model_name=args.model, quant=QuantConfig(mode=QuantMode.INT8))).load()
        info = qengine.info()
        print(f"weight bytes: {info.get('weight_bytes_unquantized', '?')} before, {info['weight_bytes']} after")
        print(repr(qengine.run("Quantized hello", max_new_tokens=n).generated_text))
        qengine.close()
        summary["quantized"] = True
    except BackendUnavailableError as exc:
        print(f"skipped: {exc}")
        summary["quantized"] = False

    section("backend comparison")
    comparison = BackendComparison(args.model, ["eager", "compiled", "vllm"], EngineConfig(max_batch_size=4))
    results = comparison.run(batch_sizes=[2], num_runs=1, max_new_tokens=min(n, 8))
    results.print_table()
    out = tempfile.mkdtemp(prefix="llminfer-demo-")
    print("artifacts:", results.save_artifacts(out))
    summary["compared"] = sorted(results.results)
    return summary


if __name__ == "__main__":
    main()
