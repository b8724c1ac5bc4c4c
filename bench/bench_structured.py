"""Structured-output benchmarks (issue 13), each figure measured side by side in one run.

1. throughput: the mixed workload of ``bench_scheduler.py`` (64 requests, prompt lengths U[16, 256], output
   lengths U[16, 256], max_batch_size 32, the ~100M-parameter Qwen2-shaped bench model, greedy) run two ways:
   * constrained: every other request carries a JSON Schema from the test corpus
     (``tests/data/json_schemas/corpus.json``) with ``max_new_tokens`` = its workload length as a cap; the
     other half is unconstrained with ``ignore_eos`` as in the scheduler bench;
   * unconstrained twin: the same requests, all unconstrained with ``ignore_eos``, where each constrained
     request's twin gets ``max_new_tokens`` = the number of tokens the constrained one produced (a constrained
     request ends when its JSON is complete, usually well before the cap).
   Both runs therefore produce the same number of tokens per request (mismatches, from bf16 numerics, are
   counted in ``requests_off_twin_length``; tokens/s uses each run's own count), with the same prompts and the
   same batch shapes step by step, so output tokens/s constrained / unconstrained isolates what constraining
   costs (compiling is warmed and cached first: it happens once per schema, off the step). Runs alternate,
   and each figure is the median over ``--reps``; the target is >= 0.9.
2. compile: every corpus schema compiled by a fresh :class:`GrammarCompiler` (no cache), p50 / p99 / max ms;
   the one-time tokenizer pass (xgrammar's ``TokenizerInfo``) is reported on its own.
3. mask share: one more constrained run with timers around the mask code the sampler calls (bitmask
   allocation, ``fill_bitmask``, ``apply_bitmask``, and the matcher's ``accept``) and around the backend's
   whole step (``HFBackend.execute``): mask time / step time. The timers add a little to both.
4. library: xgrammar against llguidance (skipped if not importable) on the corpus with the bench tokenizer,
   one thread: compile time per schema, and the next-token mask time per token along one walk through each
   grammar (random allowed tokens chosen by xgrammar's mask, seed 0, up to 32 tokens; llguidance follows the
   same tokens and stops where it would not accept one).

    python bench/bench_structured.py [--reps 2] [--num-requests 64] [--only throughput,compile,mask,library]
        [--max-len 256] [--schemas 120] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from bench_scheduler import make_engine

from common import (
    BENCH_VOCAB,
    RESULTS_DIR,
    bench_model_path,
    environment,
    parse_args,
    peak_rss_bytes,
    random_prompts,
    save,
)
from llminfer.backends import hf as hf_backend
from llminfer.logging import configure_logging
from llminfer.sampling import sampler as sampler_mod
from llminfer.sampling import structured
from llminfer.sampling.structured import GrammarCompiler, StructuredOutput

CORPUS_PATH = Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schemas" / "corpus.json"
CORPUS: list[dict[str, Any]] = json.loads(CORPUS_PATH.read_text(encoding="utf-8"))


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs`` by nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summary_ms(xs_s: list[float]) -> dict[str, float]:
    ms = [x * 1e3 for x in xs_s]
    return {"p50_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99), "max_ms": max(ms), "mean_ms": statistics.mean(ms),
            "n": len(ms)}


MAX_LEN = 256  # of the prompt and output lengths (``--max-len``)


def workload(num_requests: int) -> tuple[list[list[int]], list[int]]:
    """The mixed workload of bench_scheduler.py (same seeds)."""
    rng = random.Random(0)
    lengths = [rng.randint(16, MAX_LEN) for _ in range(num_requests)]
    outputs = [rng.randint(16, MAX_LEN) for _ in range(num_requests)]
    return random_prompts(num_requests, lengths, BENCH_VOCAB, seed=1), outputs


def constrained_requests(engine, prompts, outputs) -> list:
    return [engine.make_request(p, max_new_tokens=n, structured_output=StructuredOutput(
                json_schema=CORPUS[(i // 2) % len(CORPUS)]))
            if i % 2 == 0 else engine.make_request(p, max_new_tokens=n, ignore_eos=True)
            for i, (p, n) in enumerate(zip(prompts, outputs))]


def run_timed(engine, requests) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    results = engine.run_requests(requests)
    dt = time.perf_counter() - t0
    engine.reset_prefix_cache()  # random prompts: nothing to reuse, and each run starts alike
    return dt, [r.stats.completion_tokens for r in results]


def bench_throughput(engine, reps: int, num_requests: int) -> dict:
    prompts, outputs = workload(num_requests)
    engine.run_requests([engine.make_request(p, max_new_tokens=4, ignore_eos=True) for p in prompts[:4]])
    # Warm-up, excluded: the first run compiles (and caches) the schemas, and while a grammar compiles its
    # request waits, so that run's batches differ (bf16 logits depend on the batch: other greedy tokens);
    # the second gives the constrained lengths the twins copy.
    run_timed(engine, constrained_requests(engine, prompts, outputs))
    _, lengths = run_timed(engine, constrained_requests(engine, prompts, outputs))
    ended_early = sum(1 for i in range(0, num_requests, 2) if lengths[i] < outputs[i])
    times: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    mismatched = 0
    for rep in range(reps):
        order = ["constrained", "unconstrained"] if rep % 2 == 0 else ["unconstrained", "constrained"]
        for name in order:
            if name == "constrained":
                requests = constrained_requests(engine, prompts, outputs)
            else:
                requests = [engine.make_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
            t, produced = run_timed(engine, requests)
            mismatched += sum(a != b for a, b in zip(produced, lengths))
            times[name].append(t)
            rates[name].append(sum(produced) / t)
    total = sum(lengths)
    tps = {k: statistics.median(v) for k, v in rates.items()}
    out = {"requests": num_requests, "constrained_requests": (num_requests + 1) // 2,
           "constrained_ended_by_grammar": ended_early, "output_tokens": total,
           "constrained_output_tokens": sum(lengths[0::2]), "requests_off_twin_length": mismatched, "seconds": times, "output_tokens_per_s": tps,
           "ratio_constrained_over_unconstrained": tps["constrained"] / tps["unconstrained"],
           # Each rep's two runs are back to back: their ratio is less exposed to drift on a shared CPU.
           "ratio_per_rep": [c / u for c, u in zip(rates["constrained"], rates["unconstrained"])]}
    print(f"[throughput] {total} tokens; tok/s constrained {tps['constrained']:.1f}, unconstrained "
          f"{tps['unconstrained']:.1f}; ratio {out['ratio_constrained_over_unconstrained']:.3f} (target >= 0.9); "
          f"per rep {', '.join(f'{r:.3f}' for r in out['ratio_per_rep'])}")
    return out


def bench_compile(engine) -> dict:
    rt = engine.runtime
    compiler = GrammarCompiler(rt.grammar_compiler.tokenizer, rt.grammar_compiler.vocab_size,
                               rt.grammar_compiler.stop_token_ids, timeout_s=120)
    t0 = time.perf_counter()
    compiler.compile(StructuredOutput(choice=["warm"]))  # builds the tokenizer info once
    tokenizer_info_s = time.perf_counter() - t0
    compiler.compile_times_s.clear()
    for schema in CORPUS:
        compiler.compile(StructuredOutput(json_schema=schema))
    compiler.close()
    out = {"schemas": len(CORPUS), "tokenizer_info_s": tokenizer_info_s, **summary_ms(compiler.compile_times_s)}
    print(f"[compile] {len(CORPUS)} schemas: p50 {out['p50_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms, max "
          f"{out['max_ms']:.1f} ms (tokenizer info once: {tokenizer_info_s:.2f} s)")
    return out


class _Timer:
    """Wraps a callable and adds its wall time (s) to ``total``."""

    def __init__(self, fn) -> None:
        self.fn, self.total, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - t0
            self.calls += 1


def bench_mask_share(engine, num_requests: int) -> dict:
    prompts, outputs = workload(num_requests)
    M = structured.GrammarMatcher
    originals = {"alloc": sampler_mod.allocate_bitmask, "apply": sampler_mod.apply_bitmask,
                 "fill": M.fill_bitmask, "accept": M.accept, "step": hf_backend.HFBackend.execute}
    timers = {k: _Timer(v) for k, v in originals.items()}
    sampler_mod.allocate_bitmask, sampler_mod.apply_bitmask = timers["alloc"], timers["apply"]
    M.fill_bitmask = lambda self, bitmask, row: timers["fill"](self, bitmask, row)
    M.accept = lambda self, token: timers["accept"](self, token)
    hf_backend.HFBackend.execute = lambda self, plan: timers["step"](self, plan)
    try:
        run_timed(engine, constrained_requests(engine, prompts, outputs))
    finally:
        sampler_mod.allocate_bitmask, sampler_mod.apply_bitmask = originals["alloc"], originals["apply"]
        M.fill_bitmask, M.accept = originals["fill"], originals["accept"]
        hf_backend.HFBackend.execute = originals["step"]
    mask = sum(timers[k].total for k in ("alloc", "apply", "fill", "accept"))
    step = timers["step"].total
    out = {"steps": timers["step"].calls, "step_s": step, "mask_s": mask,
           "parts_s": {k: timers[k].total for k in ("alloc", "fill", "apply", "accept")},
           "masked_steps": timers["apply"].calls, "rows_filled": timers["fill"].calls,
           "mask_ms_per_masked_step": 1e3 * mask / max(1, timers["apply"].calls),
           "share_of_step": mask / step}
    print(f"[mask] mask {1e3 * mask:.0f} ms of {1e3 * step:.0f} ms of steps = {100 * out['share_of_step']:.2f}% "
          f"({out['mask_ms_per_masked_step']:.3f} ms per masked step, {out['rows_filled']} row fills)")
    return out


def _walk(rng: random.Random, matcher: Any, bitmask: torch.Tensor, fill, steps: int) -> tuple[list[int], list[float]]:
    """Random allowed tokens through ``matcher`` (xgrammar); returns the tokens and the fill times (s)."""
    tokens, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        fill(bitmask)
        times.append(time.perf_counter() - t0)
        words = bitmask[0]
        bits = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
        allowed = torch.nonzero(bits).flatten().tolist()
        token = rng.choice(allowed)
        if not matcher.accept_token(token) or matcher.is_terminated():
            break
        tokens.append(token)
    return tokens, times


def bench_library(engine) -> dict:
    import xgrammar

    tok = engine.tokenizer
    vocab = engine.runtime.grammar_compiler.vocab_size
    stop = engine.runtime.grammar_compiler.stop_token_ids
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=stop)
    xg_setup = time.perf_counter() - t0
    xc = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as exc:
        llguidance = None
        skipped = f"llguidance not importable: {exc}"
    else:
        skipped = None
        t0 = time.perf_counter()
        ll_tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=stop)
        ll_setup = time.perf_counter() - t0
    res: dict[str, dict[str, list[float]]] = {"xgrammar": {"compile": [], "mask": []},
                                              "llguidance": {"compile": [], "mask": []}}
    ll_stopped_early = 0
    for i, schema in enumerate(CORPUS):
        text = json.dumps(schema)
        t0 = time.perf_counter()
        compiled = xc.compile_json_schema(text, any_whitespace=False, separators=(",", ":"), strict_mode=True)
        res["xgrammar"]["compile"].append(time.perf_counter() - t0)
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        tokens, times = _walk(random.Random(i), matcher, bitmask,
                              lambda b, m=matcher: m.fill_next_token_bitmask(b, 0), 32)
        res["xgrammar"]["mask"] += times
        if llguidance is None:
            continue
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        t0 = time.perf_counter()
        lm = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        lbm = llguidance.torch.allocate_token_bitmask(1, vocab)
        llguidance.torch.fill_next_token_bitmask(lm, lbm, 0)  # its compile is lazy: the first mask finishes it
        res["llguidance"]["compile"].append(time.perf_counter() - t0)
        for j, token in enumerate(tokens):
            if j:
                t0 = time.perf_counter()
                llguidance.torch.fill_next_token_bitmask(lm, lbm, 0)
                res["llguidance"]["mask"].append(time.perf_counter() - t0)
            if not lm.consume_token(token):
                ll_stopped_early += 1
                break
    out: dict[str, Any] = {"schemas": len(CORPUS), "threads": 1, "xgrammar_version": version("xgrammar"),
                           "xgrammar_tokenizer_info_s": xg_setup,
                           "xgrammar": {k: summary_ms(v) for k, v in res["xgrammar"].items()}}
    if llguidance is None:
        out["llguidance_skipped"] = skipped
    else:
        out.update({"llguidance_version": version("llguidance"),
                    "llguidance_tokenizer_s": ll_setup, "llguidance_walks_stopped_early": ll_stopped_early,
                    "llguidance": {k: summary_ms(v) for k, v in res["llguidance"].items() if v}})
    for lib in ("xgrammar", "llguidance"):
        if lib in out:
            c, m = out[lib]["compile"], out[lib].get("mask")
            print(f"[library] {lib}: compile p50 {c['p50_ms']:.2f} / p99 {c['p99_ms']:.2f} ms; mask per token "
                  f"p50 {m['p50_ms']:.3f} / p99 {m['p99_ms']:.3f} / max {m['max_ms']:.3f} ms")
    return out


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="throughput,compile,mask,library")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256, help="upper bound of the prompt / output lengths")
    ap.add_argument("--schemas", type=int, default=len(CORPUS), help="corpus schemas for compile / library")
    args = parse_args(ap, {"reps": 1, "num_requests": 4, "max_len": 24, "schemas": 12})
    global MAX_LEN
    MAX_LEN = args.max_len
    del CORPUS[args.schemas:]  # the first N schemas for the compile and library figures
    configure_logging("warning")
    which = set(args.only.split(","))
    path = bench_model_path()
    engine = make_engine(path)
    # Merge into an earlier result so that `--only` reruns keep the other parts' figures.
    previous = RESULTS_DIR / "structured.json"
    payload: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    payload.update({"benchmark": "structured", "model": str(path), "environment": environment(),
                    "corpus": str(CORPUS_PATH.name), "corpus_schemas": len(CORPUS)})
    try:
        if "throughput" in which:
            payload["throughput"] = bench_throughput(engine, args.reps, args.num_requests)
        if "compile" in which:
            payload["compile"] = bench_compile(engine)
        if "mask" in which:
            payload["mask"] = bench_mask_share(engine, args.num_requests)
        if "library" in which:
            payload["library"] = bench_library(engine)
    finally:  # what finished is saved even if a later part fails
        engine.close()
        payload["peak_rss_bytes"] = peak_rss_bytes()
        print(f"-> {save('structured', payload)}")
    return payload


if __name__ == "__main__":
    main()
