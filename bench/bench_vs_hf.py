"""llminfer vs Hugging Face generate(): batch 32, 32-token prompts, 64 new tokens, same prompts, in
common.BENCH_DTYPE (what dtype="auto" picks here: float32 on an AVX2-only CPU), same process, measured
side by side (alternating repetitions, medians). Output tokens/s counts tokens actually generated.

    python bench/bench_vs_hf.py [--reps 3] [--batch 32] [--prompt-len 32] [--new-tokens 64] [--quick]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from common import (
    BENCH_DTYPE,
    BENCH_TORCH_DTYPE,
    BENCH_VOCAB,
    bench_model_path,
    count_params,
    environment,
    median,
    parse_args,
    peak_rss_bytes,
    random_prompts,
    save,
    timed,
)
from llminfer import CacheConfig, EngineConfig, InferenceEngine, SchedulerConfig
from llminfer.logging import configure_logging


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> int:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
    return (out.shape[1] - ids.shape[1]) * out.shape[0]


def llminfer_generate(engine, prompts: list[list[int]], new_tokens: int) -> int:
    results = engine.run_batch_continuous(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return sum(r.stats.completion_tokens for r in results)


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = parse_args(ap, {"reps": 1, "batch": 8, "prompt_len": 16, "new_tokens": 8})
    configure_logging("warning")
    path = bench_model_path()
    prompts = random_prompts(args.batch, args.prompt_len, BENCH_VOCAB, seed=0)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=BENCH_TORCH_DTYPE, attn_implementation="sdpa").eval()
    cfg = EngineConfig(model_name=str(path), dtype=BENCH_DTYPE, device="cpu", max_batch_size=args.batch,
                       batch_timeout_ms=0, cache=CacheConfig(page_size_tokens=16),
                       scheduler=SchedulerConfig(max_num_batched_tokens=4096))
    engine = InferenceEngine(cfg).load().start()

    # Warm-up (excluded): one small run each.
    hf_generate(hf, prompts[:4], 4)
    llminfer_generate(engine, prompts[:4], 4)

    hf_s, ours_s = [], []
    for _ in range(args.reps):
        t, n_hf = timed(hf_generate, hf, prompts, args.new_tokens)
        hf_s.append(t)
        t, n_ours = timed(llminfer_generate, engine, prompts, args.new_tokens)
        ours_s.append(t)
    engine.close()
    hf_tps = n_hf / median(hf_s)
    ours_tps = n_ours / median(ours_s)
    payload = {
        "benchmark": "llminfer_vs_hf_generate",
        "model": {"path": str(path), "parameters": count_params(path), "dtype": BENCH_DTYPE},
        "workload": {"batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "reps": args.reps},
        "hf_generate": {"seconds": hf_s, "output_tokens": n_hf, "tokens_per_s": hf_tps},
        "llminfer": {"seconds": ours_s, "output_tokens": n_ours, "tokens_per_s": ours_tps,
                     "kv_budget_bytes": engine.kv_cache.nbytes},
        "ratio_llminfer_over_hf": ours_tps / hf_tps,
        "peak_rss_bytes": peak_rss_bytes(),
        "environment": environment(),
    }
    out = save("llminfer_vs_hf", payload)
    print(f"model: {payload['model']['parameters'] / 1e6:.0f}M params, {BENCH_DTYPE}, CPU, {torch.get_num_threads()} threads")
    print(f"HF generate : {hf_tps:8.1f} output tok/s  (median of {args.reps}: {median(hf_s):.2f} s)")
    print(f"llminfer    : {ours_tps:8.1f} output tok/s  (median of {args.reps}: {median(ours_s):.2f} s)")
    print(f"ratio llminfer / HF generate = {payload['ratio_llminfer_over_hf']:.2f}   -> {out}")
    return payload


if __name__ == "__main__":
    main()
