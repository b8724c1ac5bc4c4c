"""Speculative decoding: acceptance rate and speed over plain decoding, side by side in one run.

Without ``--model`` (results/speculative.json): draft-model speculation on the ~102M Qwen2-shaped benchmark
model (common.BENCH_DTYPE, CPU). Drafts: the target itself (acceptance must be 100%), and a 2-layer model of
the same width and vocabulary. Greedy, 8 prompts of 32 tokens, 64 new tokens. Random weights mean a separate
draft agrees with the target only by chance: that row shows the cost of speculation when drafts are
rejected, the draft = target row its upper bound on acceptance.

With ``--model NAME`` (results/speculative_lookup.json): prompt-lookup (n-gram) drafting against plain
decoding on a trained chat model (``common.TRAINED_MODEL`` by default in ``run_all.py``), fp32, on a
summarise-the-prompt workload: ``common.ENGLISH_PASSAGES`` (4 passages of ~110 words) in a chat turn
"Summarise the following text...", greedy, up to ``--new-tokens`` tokens (EOS ends a reply), one request at a
time (batch 1, where decoding is slowest per token and speculation helps most). Both engines live in this
process and take turns per prompt and round (ABAB), so load changes hit both; tokens/s is generated tokens
over wall time summed over the prompts, median over rounds. The load average before and after is recorded.

    python bench/bench_speculative.py [--reps 2] [--k 4] [--num-prompts 8] [--new-tokens 64] [--quick]
    python bench/bench_speculative.py --model llminfer/smollm2-135m-instruct [--reps 3] [--k 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from common import (
    BENCH_DTYPE,
    BENCH_MODEL_SPEC,
    BENCH_VOCAB,
    ENGLISH_PASSAGES,
    bench_model_path,
    environment,
    parse_args,
    random_prompts,
    save,
    skip_payload,
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


def lookup_engine(model: str, k: int | None, lookup_min: int, lookup_max: int):
    """fp32, batch 1; ``k=None``: plain decoding, else prompt lookup with ``k`` drafts per step."""
    spec = dict(speculative_method="ngram", speculative_num_assistant_tokens=k,
                speculative_prompt_lookup_min=lookup_min, speculative_prompt_lookup_max=lookup_max) if k else {}
    cfg = EngineConfig(model_name=model, dtype="float32", device="cpu", max_batch_size=1, batch_timeout_ms=0,
                       **spec)
    return InferenceEngine(cfg).load()


def prompt_lookup(args) -> dict:
    """Plain vs prompt-lookup decoding on the summarise workload of a trained model (see the docstring)."""
    from llminfer.errors import LLMInferError

    load_before = os.getloadavg()
    try:
        engines = {"plain": lookup_engine(args.model, None, 0, 0),
                   "prompt-lookup": lookup_engine(args.model, args.k, args.lookup_min, args.lookup_max)}
    except LLMInferError as exc:
        return skip_payload("speculative_lookup", f"cannot load {args.model}: {exc}")
    tok = engines["plain"].tokenizer
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Summarise the following text in a few sentences.\n\n" + text}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False)
        for text in ENGLISH_PASSAGES[: args.num_prompts]]
    for e in engines.values():
        e.run(prompts[0], max_new_tokens=4)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in engines}
    tokens: dict[str, list[list[int]]] = {}
    counts = {k: [0, 0] for k in engines}  # proposed, accepted
    for _ in range(args.reps):
        elapsed = {k: 0.0 for k in engines}
        for name in engines:
            tokens[name] = []
        for prompt in prompts:
            for name, e in engines.items():
                t0 = time.perf_counter()
                r = e.run(prompt, max_new_tokens=args.new_tokens)
                elapsed[name] += time.perf_counter() - t0
                tokens[name].append(list(r.token_ids))
                counts[name][0] += r.stats.spec_proposed_tokens
                counts[name][1] += r.stats.spec_accepted_tokens
        for name in engines:
            times[name].append(elapsed[name])
    for e in engines.values():
        e.close()
    generated = sum(len(t) for t in tokens["plain"])
    tps = {k: generated / statistics.median(v) for k, v in times.items()}
    proposed, accepted = counts["prompt-lookup"]
    payload = {
        "benchmark": "speculative_prompt_lookup", "model": args.model, "dtype": "float32", "batch_size": 1,
        "k": args.k, "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max,
        "num_prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": args.new_tokens,
        "generated_tokens": generated, "reps": args.reps, "seconds_per_round": times, "output_tokens_per_s": tps,
        "speed_ratio_vs_plain": {k: v / tps["plain"] for k, v in tps.items()},
        "acceptance_rate": accepted / proposed if proposed else None,
        "accepted_tokens_per_generated_token": accepted / (generated * args.reps),
        "greedy_identical": tokens["prompt-lookup"] == tokens["plain"],
        "torch_threads": torch.get_num_threads(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "environment": environment(),
    }
    print(f"[speculative] {args.model}, summarise workload, {len(prompts)} prompts, {generated} tokens, batch 1, "
          f"{args.reps} rounds ABAB")
    for name in engines:
        print(f"[speculative] {name:14s} {tps[name]:7.1f} tok/s  x{payload['speed_ratio_vs_plain'][name]:.2f}")
    print(f"[speculative] acceptance {payload['acceptance_rate'] or 0:.0%} of drafts; "
          f"{payload['accepted_tokens_per_generated_token']:.0%} of tokens came from accepted drafts; "
          f"identical={payload['greedy_identical']}; load average {load_before[0]:.2f} -> "
          f"{payload['load_average_after'][0]:.2f}")
    print(f"-> {save('speculative_lookup', payload)}")
    return payload


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="a trained model: prompt lookup vs plain on the summarise "
                    "workload instead of the draft-model rows")
    ap.add_argument("--lookup-min", type=int, default=2, help="--model: shortest n-gram matched")
    ap.add_argument("--lookup-max", type=int, default=4, help="--model: longest n-gram matched")
    args = parse_args(ap, {"reps": 1, "num_prompts": 4, "new_tokens": 8})
    configure_logging("warning")
    if args.model:
        return prompt_lookup(args)
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
