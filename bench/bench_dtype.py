"""``dtype="auto"`` against bfloat16 on this CPU: decode speed, side by side in one run (issue 17).

The bench model (a bf16 checkpoint) loads twice: with ``dtype="auto"`` (what llminfer picks from the CPU:
float32 on an AVX2-only CPU, where bf16 matmuls are emulated; bfloat16 where the CPU computes it natively,
in which case both engines run the same dtype and the ratio is ~1) and with ``dtype="bfloat16"``. Each
runs greedy decode at batch 1 (ms per output token after the first, the median over ``--reps``), sampled
decode at batch 1 (temperature 1: every logit, where greedy fp32 may take the argmax screen), and greedy at
batch ``--batch`` (output tokens/s of the whole batch, submitted at once to the continuous-batching
scheduler). Repetitions alternate the order of the engines. The figure is speed(auto) / speed(bf16);
the issue asks >= 2 on an AVX2-only CPU. Where auto picked a half type, a third engine runs float32 next
to it (``speed_ratio_float32_over_auto``). bf16 steps of up to 4 rows run on llminfer's ``bf16_linear``
where the CPU has AVX-512 BF16; ``LLMINFER_CPU_KERNEL_BF16=0`` keeps them on torch's matmul, to compare
(on a 2-core Xeon with AMX: bf16 batch-1 11.8 against 15.7 ms per token, fp32 18.7).

``--model`` runs another model instead (a folder, a ``.gguf`` file or a built-in name such as
``llminfer/smollm2-135m-instruct``, the trained model, whose GGUF loads in float32, so ``auto`` is float32 there and
bf16 runs beside it).

``--busy`` runs the measured repetitions (not the loads, so not the dtype measurement, which a quiet first load
caches) beside another process spinning on one core (``bench_busy_neighbour.py``'s bounded spin loop).

    python bench/bench_dtype.py [--reps 3] [--new-tokens 32] [--batch 32] [--quick] [--model NAME] [--busy]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_busy_neighbour import loadavg, neighbour

from common import BENCH_VOCAB, bench_model_path, environment, parse_args, random_prompts, save, timed
from llminfer import CacheConfig, EngineConfig, InferenceEngine
from llminfer.logging import configure_logging


def _engine(path, dtype: str, batch: int) -> InferenceEngine:
    cfg = EngineConfig(model_name=str(path), dtype=dtype, device="cpu", max_batch_size=batch, batch_timeout_ms=0,
                       cache=CacheConfig(page_size_tokens=16, kv_cache_memory_bytes=256 << 20))
    return InferenceEngine(cfg).load().start()


def measure(engines: dict, args: argparse.Namespace, vocab: int, kw: dict, ms_per_token: dict, sampled_ms: dict,
            batch_tps: dict) -> None:
    """``args.reps`` repetitions, the engines' order alternating: batch-1 greedy and sampled ms per token after the
    first, and batch ``args.batch`` output tok/s, appended to the three dicts by engine name."""
    for rep in range(args.reps):
        order = list(engines.items()) if rep % 2 == 0 else list(engines.items())[::-1]
        for name, e in order:
            prompt = random_prompts(1, args.prompt_tokens, vocab, seed=100 + rep)[0]
            st = e.run(prompt, **kw).stats
            ms_per_token[name].append((st.total_latency_ms - st.ttft_ms) / max(1, st.completion_tokens - 1))
            st = e.run(prompt, temperature=1.0, seed=rep, **kw).stats  # full logits: no argmax screen
            sampled_ms[name].append((st.total_latency_ms - st.ttft_ms) / max(1, st.completion_tokens - 1))
            prompts = random_prompts(args.batch, args.prompt_tokens, vocab, seed=200 + rep)
            seconds, results = timed(e.run_batch_continuous, prompts, **kw)
            batch_tps[name].append(sum(r.stats.completion_tokens for r in results) / seconds)


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--busy", action="store_true", help="measure beside a process spinning on one core")
    ap.add_argument("--model", default=None, help="a model folder, .gguf file or built-in name (default: the bench model)")
    args = parse_args(ap, {"reps": 1, "new_tokens": 8, "batch": 8})
    configure_logging("warning")
    path = args.model or bench_model_path()
    # The first engine a process loads decoded 5-10 % slower than later ones of the same dtype on the trained
    # model (bf16, auto = bf16, bf16 loaded in that order: 21.8, 20.2, 20.0 ms/token), so an unmeasured pilot
    # takes that place.
    pilot = _engine(path, "float32", 1)
    engines = {"auto": _engine(path, "auto", args.batch), "bfloat16": _engine(path, "bfloat16", args.batch)}
    if engines["auto"].runtime.dtype != torch.float32:
        # Where auto picks a half type (native bf16/fp16), float32 runs next to it: the CPU kernels
        # (skinny_linear, paged_decode_attention) serve fp32 only, so batch 1 may favour fp32 even there.
        engines["float32"] = _engine(path, "float32", args.batch)
    chosen = {k: str(e.runtime.dtype).replace("torch.", "") for k, e in engines.items()}
    # auto settled by measurement where the flag rule picked a half type (llminfer.models.dtype_probe)
    probe, auto_reason = engines["auto"].runtime.dtype_probe, engines["auto"].runtime.dtype_reason
    kw = dict(max_new_tokens=args.new_tokens, ignore_eos=True)
    vocab = min(BENCH_VOCAB, engines["auto"].tokenizer.vocab_size)
    for e in engines.values():  # warm-up, excluded
        e.run_batch_continuous(random_prompts(2, args.prompt_tokens, vocab, seed=7), max_new_tokens=4)
    ms_per_token: dict[str, list[float]] = {k: [] for k in engines}
    batch_tps: dict[str, list[float]] = {k: [] for k in engines}
    sampled_ms: dict[str, list[float]] = {k: [] for k in engines}
    load_before = loadavg()
    with neighbour(args.busy, 900.0):
        measure(engines, args, vocab, kw, ms_per_token, sampled_ms, batch_tps)
    load_after = loadavg()
    for e in [*engines.values(), pilot]:
        e.close()
    b1 = {k: statistics.median(v) for k, v in ms_per_token.items()}
    bn = {k: statistics.median(v) for k, v in batch_tps.items()}
    b1_sampled = {k: statistics.median(v) for k, v in sampled_ms.items()}
    payload = {
        "benchmark": "dtype_auto_vs_bf16", "model": str(path), "dtype_chosen": chosen,
        "dtype_reason": auto_reason, "dtype_probe": probe,
        "flag_rule_reason": environment()["cpu_dtype"]["auto_reason"],
        "batch1_ms_per_token": b1, "batch1_ms_per_token_runs": ms_per_token,
        "batch1_sampled_ms_per_token": b1_sampled, "batch1_sampled_ms_per_token_runs": sampled_ms,
        "batch": args.batch, "batch_output_tokens_per_s": bn, "batch_output_tokens_per_s_runs": batch_tps,
        "speed_ratio_auto_over_bf16": {"batch_1": b1["bfloat16"] / b1["auto"],
                                       f"batch_{args.batch}": bn["auto"] / bn["bfloat16"]},
        **({"speed_ratio_float32_over_auto": {"batch_1": b1["auto"] / b1["float32"],
                                               f"batch_{args.batch}": bn["float32"] / bn["auto"]}}
           if "float32" in engines else {}),
        "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens, "reps": args.reps, "busy": args.busy,
        "loadavg_before": load_before, "loadavg_after": load_after,
        "environment": environment(),
    }
    r = payload["speed_ratio_auto_over_bf16"]
    print(f"[dtype] auto = {chosen['auto']}; batch 1: auto {b1['auto']:.1f} ms/token, bf16 {b1['bfloat16']:.1f} "
          f"ms/token (x{r['batch_1']:.2f}); batch {args.batch}: auto {bn['auto']:.1f} tok/s, bf16 "
          f"{bn['bfloat16']:.1f} tok/s (x{r[f'batch_{args.batch}']:.2f})")
    if "float32" in engines:
        f = payload["speed_ratio_float32_over_auto"]
        print(f"[dtype] float32 next to auto: batch 1 {b1['float32']:.1f} ms/token (x{f['batch_1']:.2f} auto's speed); "
              f"batch {args.batch} {bn['float32']:.1f} tok/s (x{f[f'batch_{args.batch}']:.2f})")
    print("[dtype] batch 1 sampled (temperature 1, full logits): " + ", ".join(
        f"{k} {v:.1f} ms/token" for k, v in b1_sampled.items()))
    print(f"[dtype] load average before {load_before}, after {load_after}" + (" (one core kept busy)" if args.busy else ""))
    print(f"-> {save('dtype_auto', payload)}")
    return payload


if __name__ == "__main__":
    main()
