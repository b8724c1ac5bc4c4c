"""Scheduler and KV-cache benchmarks (issue 3), each figure a ratio measured side by side in one run.

1. mixed: 64 requests, prompt lengths U[16, 256], output lengths U[16, 256] (EOS ignored), max_batch_size 32.
   llminfer continuous batching vs HF generate() in static batches of 32 (left padding, each batch runs to
   its longest requested output) vs transformers' own continuous batching (generate_batch manager).
   Throughput counts the requested output tokens each engine actually delivered. llminfer runs twice: FCFS
   (the default, the headline figure) and with the priority policy given priority = -max_new_tokens
   (longest output first, the LPT rule for makespan: the tail of the run stays fuller).
2. shared_prefix: 16 requests sharing a 1,024-token prefix with distinct 32-token suffixes, one at a time:
   mean TTFT with a warm prefix cache over mean TTFT with prefix caching off.
3. zero_hit: unique prompts (0% hit rate): throughput with prefix caching on over off.

All in :data:`common.BENCH_DTYPE` (what ``dtype="auto"`` picks here: float32 on an AVX2-only CPU). The three
llminfer engines (prefix cache on, off, priority policy) are loaded once and shared by the workloads.
``--quick`` leaves out transformers' continuous batching (its start-up alone takes ~17 s on 2 cores).

    python bench/bench_scheduler.py [--only mixed,shared_prefix,zero_hit] [--reps 2] [--num-requests 64]
        [--max-len 256] [--prefix-len 1024] [--prefix-requests 16] [--zero-hit-requests 32]
        [--no-hf-continuous] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from common import (
    BENCH_DTYPE,
    BENCH_TORCH_DTYPE,
    BENCH_VOCAB,
    RESULTS_DIR,
    bench_model_path,
    environment,
    parse_args,
    peak_rss_bytes,
    random_prompts,
    save,
    timed,
)
from llminfer import CacheConfig, EngineConfig, InferenceEngine, SchedulerConfig
from llminfer.logging import configure_logging

_ENGINES: dict[tuple, InferenceEngine] = {}


def make_engine(path, *, prefix_cache: bool = True, max_batch_size: int = 32, policy: str = "fcfs") -> InferenceEngine:
    """An engine with these settings, loaded once per process and shared by the suites (its prefix cache
    emptied before it is handed out): loading is most of a ``--quick`` run. :func:`close_engines` ends them."""
    key = (str(path), prefix_cache, max_batch_size, policy)
    if key in _ENGINES:
        _ENGINES[key].reset_prefix_cache()
        return _ENGINES[key]
    cfg = EngineConfig(model_name=str(path), dtype=BENCH_DTYPE, device="cpu", max_batch_size=max_batch_size,
                       batch_timeout_ms=0,
                       cache=CacheConfig(page_size_tokens=16, enable_prefix_cache=prefix_cache,
                                         kv_cache_memory_bytes=1 << 30),
                       scheduler=SchedulerConfig(max_num_batched_tokens=2048, policy=policy))
    _ENGINES[key] = InferenceEngine(cfg).load().start()
    return _ENGINES[key]


def close_engines() -> None:
    while _ENGINES:
        _ENGINES.popitem()[1].close()


def llminfer_workload(engine, prompts, outputs, longest_first: bool = False) -> int:
    """Run the workload; with ``longest_first`` each request's priority is minus its output budget (the
    engine must use the priority policy), so long requests start first and the tail runs fuller."""
    requests = [engine.make_request(p, max_new_tokens=n, ignore_eos=True, priority=-n if longest_first else 0)
                for p, n in zip(prompts, outputs)]
    results = engine.run_requests(requests)
    return sum(r.stats.completion_tokens for r in results)


def hf_static(model, prompts, outputs, batch: int = 32) -> int:
    delivered = 0
    for start in range(0, len(prompts), batch):
        ps, outs = prompts[start : start + batch], outputs[start : start + batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        n = max(outs)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=0)
        assert out.shape[1] - width == n
        delivered += sum(outs)  # each request gets the tokens it asked for; the rest of the batch's is waste
    return delivered


def hf_continuous(model, prompts, outputs) -> int:
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=-1, pad_token_id=0)
    delivered = 0
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as manager:
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, outputs)]
        pending = set(ids)
        deadline = time.monotonic() + 3600
        while pending and time.monotonic() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                pending.discard(result.request_id)
                delivered += len(result.generated_tokens)
    if pending:
        raise RuntimeError(f"{len(pending)} requests did not finish")
    return delivered


def bench_mixed(path, reps: int, num_requests: int, max_len: int = 256, hf_cb: bool = True) -> dict:
    rng = random.Random(0)
    lengths = [rng.randint(16, max_len) for _ in range(num_requests)]
    outputs = [rng.randint(16, max_len) for _ in range(num_requests)]
    prompts = random_prompts(num_requests, lengths, BENCH_VOCAB, seed=1)
    requested = sum(outputs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=BENCH_TORCH_DTYPE, attn_implementation="sdpa").eval()
    engine = make_engine(path)
    lpt_engine = make_engine(path, policy="priority")
    # Warm-up, excluded.
    llminfer_workload(engine, prompts[:4], [4] * 4)
    llminfer_workload(lpt_engine, prompts[:4], [4] * 4, longest_first=True)
    lpt_engine.reset_prefix_cache()
    hf_static(model, prompts[:4], [4] * 4)
    engine.reset_prefix_cache()

    cb_model = None
    cb_skip = None if hf_cb else "not run (--no-hf-continuous; --quick skips it: its start-up alone is ~17 s)"
    try:
        if not hf_cb:
            raise LookupError(cb_skip)
        cb_model = AutoModelForCausalLM.from_pretrained(path, dtype=BENCH_TORCH_DTYPE,
                                                        attn_implementation="sdpa").eval()
        hf_continuous(cb_model, prompts[:2], [4, 4])
    except LookupError:
        pass
    except Exception as exc:  # noqa: BLE001 - report, never crash the suite
        cb_skip = f"{type(exc).__name__}: {exc}"[:300]
        cb_model = None

    times: dict[str, list[float]] = {"llminfer": [], "llminfer_longest_first": [], "hf_static": [],
                                     "hf_continuous": []}
    delivered: dict[str, int] = {}
    for _ in range(reps):
        t, delivered["llminfer"] = timed(llminfer_workload, engine, prompts, outputs)
        times["llminfer"].append(t)
        engine.reset_prefix_cache()  # distinct random prompts: nothing to reuse anyway
        t, delivered["llminfer_longest_first"] = timed(llminfer_workload, lpt_engine, prompts, outputs, True)
        times["llminfer_longest_first"].append(t)
        lpt_engine.reset_prefix_cache()
        t, delivered["hf_static"] = timed(hf_static, model, prompts, outputs)
        times["hf_static"].append(t)
        if cb_model is not None:
            t, delivered["hf_continuous"] = timed(hf_continuous, cb_model, prompts, outputs)
            times["hf_continuous"].append(t)
    tps = {k: delivered[k] / statistics.median(v) for k, v in times.items() if v}
    out = {
        "requests": num_requests, "requested_output_tokens": requested,
        "seconds": times, "output_tokens_per_s": tps,
        "ratio_vs_hf_static": tps["llminfer"] / tps["hf_static"],
        "ratio_longest_first_vs_hf_static": tps["llminfer_longest_first"] / tps["hf_static"],
        "ratio_vs_hf_continuous": tps["llminfer"] / tps["hf_continuous"] if "hf_continuous" in tps else None,
        "hf_continuous_skipped": cb_skip,
        "kv_budget_bytes": 1 << 30,
    }
    print("[mixed] output tok/s: " + ", ".join(f"{k} {v:.1f}" for k, v in tps.items()))
    print(f"[mixed] llminfer / HF static batches = {out['ratio_vs_hf_static']:.2f} (FCFS), "
          f"{out['ratio_longest_first_vs_hf_static']:.2f} (priority = longest output first)")
    if out["ratio_vs_hf_continuous"] is not None:
        print(f"[mixed] llminfer / transformers continuous batching = {out['ratio_vs_hf_continuous']:.2f}")
    else:
        print(f"[mixed] transformers continuous batching skipped: {cb_skip}")
    return out


def bench_shared_prefix(path, reps: int, prefix_len: int = 1024, num_requests: int = 16) -> dict:
    prefix = random_prompts(1, prefix_len, BENCH_VOCAB, seed=2)[0]
    suffixes = random_prompts(num_requests, 32, BENCH_VOCAB, seed=3)
    prompts = [prefix + s for s in suffixes]
    ttft: dict[str, list[float]] = {"cache_off": [], "warm_cache": []}
    engines = {"cache_off": make_engine(path, prefix_cache=False), "warm_cache": make_engine(path)}
    for eng in engines.values():
        eng.run(random_prompts(1, 64, BENCH_VOCAB, seed=9)[0], max_new_tokens=2)  # warm-up
    engines["warm_cache"].run(prefix + [5, 6, 7], max_new_tokens=1)  # warm the prefix
    cached = prompt_tokens = 0
    for _ in range(reps):
        for name, eng in engines.items():
            for p in prompts:
                stats = eng.run(p, max_new_tokens=2, ignore_eos=True).stats
                ttft[name].append(stats.ttft_ms)
                if name == "warm_cache":  # the request's own counts: the engine's totals span earlier suites
                    cached += stats.cached_tokens
                    prompt_tokens += stats.prompt_tokens
    hit_rate = cached / prompt_tokens
    mean = {k: statistics.mean(v) for k, v in ttft.items()}
    out = {"mean_ttft_ms": mean, "ratio_warm_over_off": mean["warm_cache"] / mean["cache_off"],
           "token_hit_rate": hit_rate}
    print(f"[shared_prefix] mean TTFT: off {mean['cache_off']:.1f} ms, warm {mean['warm_cache']:.1f} ms, "
          f"ratio {out['ratio_warm_over_off']:.3f}")
    return out


def bench_zero_hit(path, reps: int, num_requests: int = 32, new_tokens: int = 64, max_len: int = 256) -> dict:
    rng = random.Random(5)
    lengths = [rng.randint(64, max(64, max_len)) for _ in range(num_requests)]
    engines = {"cache_off": make_engine(path, prefix_cache=False), "cache_on": make_engine(path)}
    for eng in engines.values():
        llminfer_workload(eng, random_prompts(4, 32, BENCH_VOCAB, seed=99), [4] * 4)
    times: dict[str, list[float]] = {k: [] for k in engines}
    hits_before = engines["cache_on"].cache_stats()["hits"]
    seed = 100
    for rep in range(reps):
        # Alternate which engine goes first: on a shared 2-core machine, drift between back-to-back runs is
        # of the size of the effect being measured.
        order = list(engines.items()) if rep % 2 == 0 else list(engines.items())[::-1]
        for name, eng in order:
            seed += 1
            prompts = random_prompts(num_requests, lengths, BENCH_VOCAB, seed=seed)  # fresh: 0% hits
            t, n = timed(llminfer_workload, eng, prompts, [new_tokens] * num_requests)
            times[name].append(t)
    hits = engines["cache_on"].cache_stats()["hits"] - hits_before
    tps = {k: num_requests * new_tokens / statistics.median(v) for k, v in times.items()}
    out = {"output_tokens_per_s": tps, "ratio_on_over_off": tps["cache_on"] / tps["cache_off"],
           "hits_observed": hits, "seconds": times}
    print(f"[zero_hit] tok/s: off {tps['cache_off']:.1f}, on {tps['cache_on']:.1f}; "
          f"on/off = {out['ratio_on_over_off']:.3f} (hits observed: {hits})")
    return out


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", default="mixed,shared_prefix,zero_hit")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256, help="upper bound of the prompt / output lengths")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--prefix-requests", type=int, default=16)
    ap.add_argument("--zero-hit-requests", type=int, default=32)
    ap.add_argument("--zero-hit-tokens", type=int, default=64)
    ap.add_argument("--zero-hit-reps", type=int, default=None, help="default: max(2 x reps + 1, 5)")
    ap.add_argument("--hf-continuous", action=argparse.BooleanOptionalAction, default=True,
                    help="also run transformers' continuous batching in the mixed workload")
    args = parse_args(ap, {"reps": 1, "num_requests": 8, "max_len": 32, "prefix_len": 256, "prefix_requests": 4,
                           "zero_hit_requests": 8, "zero_hit_tokens": 8, "zero_hit_reps": 2,
                           "hf_continuous": False})
    configure_logging("warning")
    path = bench_model_path()
    which = set(args.only.split(","))
    # Merge into an earlier result so that `--only` reruns keep the other suites' figures.
    previous = RESULTS_DIR / "scheduler_kv.json"
    payload: dict = json.loads(previous.read_text()) if previous.exists() else {}
    payload.update({"benchmark": "scheduler_kv", "model": str(path), "environment": environment()})
    if "mixed" in which:
        payload["mixed"] = bench_mixed(path, args.reps, args.num_requests, args.max_len, args.hf_continuous)
    if "shared_prefix" in which:
        payload["shared_prefix"] = bench_shared_prefix(path, args.reps, args.prefix_len, args.prefix_requests)
    if "zero_hit" in which:
        payload["zero_hit"] = bench_zero_hit(path, args.zero_hit_reps or max(2 * args.reps + 1, 5),
                                             args.zero_hit_requests, args.zero_hit_tokens, args.max_len)
    engines = len(_ENGINES)
    close_engines()
    payload["peak_rss_bytes"] = peak_rss_bytes()
    print(f"peak process memory: {payload['peak_rss_bytes'] / 2**30:.2f} GiB (KV budget 1.00 GiB per engine, "
          f"{engines} engines)")
    path_out = save("scheduler_kv", payload)
    print(f"-> {path_out}")
    return payload


if __name__ == "__main__":
    main()
