"""The prepared device check: one run on a lent GPU (H200), at most 8 minutes, no network; one JSON out.

It measures, in one process:

* ``exactness``: greedy output of llminfer (Triton attention, CUDA graphs on) equals HF ``generate()``
  token for token, fp32, on random-weight Llama and Qwen2 models;
* ``bandwidth``: the device's copy bandwidth (bytes read + written per second, 1 GiB copies) and batch-1
  decode on the throughput model: step time (ms, from each request's (latency - TTFT) / (tokens - 1)),
  bytes read per step (weights + the KV of the mean context) and their ratio to the copy bandwidth, with
  CUDA graphs on and off;
* ``throughput``: nano-vllm's benchmark recipe: a random-weight Qwen3-0.6B-shaped model (Qwen2-0.5B shape
  when transformers has no Qwen3), bf16, 256 requests with prompt and output lengths uniform in 100..1024
  (seed 0), EOS ignored; output tokens/s of llminfer, of HF ``generate()`` in static batches of 64 and of
  transformers' continuous batching (``generate_batch`` manager), and the ratios.

Every section guards against the time budget (``--budget-s``, default 450 s) and records an error
instead of failing the others. ``--dry-run`` runs every code path on CPU with tiny shapes (Triton kernels in
the interpreter; the CUDA-graph runner without capture); the test suite runs it.

Recipe for a machine with torch, triton and transformers but no network: on a machine with network, from
the repository root, carry llminfer's other dependencies as wheels in the ignored folder ``bench/wheels``::

    pip download --dest bench/wheels --only-binary=:all: --python-version 3.11 \\
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \\
        attrs cattrs anyio structlog polars typer xgrammar safetensors tokenizers numpy

then on the device machine ``bash bench/gpu_check.sh`` (it installs them from there with ``--no-index``
when any is missing, runs this script with ``PYTHONPATH=src`` and writes ``$OUT/gpu_check.json``, or
``bench/results/gpu_check.json`` without ``$OUT``).

    python bench/gpu_check.py [--dry-run] [--out PATH] [--budget-s 450]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from llminfer import CacheConfig, EngineConfig, InferenceEngine, SchedulerConfig  # noqa: E402
from llminfer.logging import configure_logging  # noqa: E402
from llminfer.models import build_random_model  # noqa: E402

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
                 tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                 tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6)


class Budget:
    """Seconds left of the run's budget; sections ask before they start."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def section(results: dict, name: str, budget: Budget, need_s: float, fn, *args) -> None:
    """Run ``fn`` into ``results[name]``; an exception or too little time left is recorded, not raised."""
    t0 = time.monotonic()
    if budget.left() < need_s:
        results[name] = {"skipped": f"{budget.left():.0f} s left, needs ~{need_s:.0f} s"}
        return
    try:
        results[name] = fn(*args)
    except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    results[name]["seconds"] = round(time.monotonic() - t0, 1)
    print(f"[gpu_check] {name}: {time.monotonic() - t0:.1f} s", flush=True)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_config(path: Path, device: str, dtype: str, *, max_batch_size: int, max_model_len: int,
                  cuda_graphs: bool = True, max_tokens: int = 8192, num_blocks: int | None = None) -> EngineConfig:
    return EngineConfig(model_name=str(path), dtype=dtype, device=device, max_batch_size=max_batch_size,
                        batch_timeout_ms=0, max_model_len=max_model_len, attention_backend="triton",
                        cuda_graphs=cuda_graphs, enable_tracing=False,
                        cache=CacheConfig(page_size_tokens=16, gpu_memory_utilization=0.6, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=max_tokens))


def load_engine(cfg: EngineConfig, cpu_graphs: bool) -> InferenceEngine:
    """Load an engine; on CPU with ``cpu_graphs`` the CUDA-graph runner runs without capture (dry run)."""
    engine = InferenceEngine(cfg).load()
    if cpu_graphs and cfg.device == "cpu" and cfg.cuda_graphs:
        from llminfer.backends.cuda_graphs import DecodeGraphRunner

        runner = DecodeGraphRunner(engine.backend.model, engine.backend.cache, cfg.max_batch_size,
                                   engine.max_model_len, capture=False)
        runner.capture_all()
        engine.backend.graphs = runner
    return engine.start()


# ------------------------------------------------------------------------------------------- exactness
def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(device).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            out.append(gen[0, len(p):].tolist())
    del model
    free_memory()
    return out


def check_exactness(root: Path, device: str, dry: bool) -> dict:
    lengths, new_tokens = ([1, 5], 2) if dry else ([1, 7, 33, 120, 500], 32)
    rng = random.Random(7)
    prompts = [[rng.randrange(150_000) for _ in range(n)] for n in lengths]
    out: dict[str, Any] = {"prompt_lengths": lengths, "new_tokens": new_tokens}
    archs = (("llama", 1),) if dry else (("llama", 1), ("qwen2", 2))  # the dry run checks the loop once
    for arch, seed in archs:
        path = build_random_model(root / f"exact-{arch}", architecture=arch, hidden_size=64, num_layers=2,
                                  num_heads=4, num_kv_heads=2, intermediate_size=128, seed=seed)
        want = hf_greedy(path, prompts, new_tokens, device)
        cfg = engine_config(path, device, "float32", max_batch_size=4, max_model_len=1024, max_tokens=256,
                            num_blocks=512)
        with load_engine(cfg, cpu_graphs=True) as engine:
            got = [list(r.token_ids) for r in engine.run_batch_continuous(
                prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens)]
            graphs = engine.info().get("cuda_graphs")
        del engine
        free_memory()
        out[arch] = {"match": got == want, "matching_prompts": sum(g == w for g, w in zip(got, want)),
                     "cuda_graphs": graphs}
    out["all_match"] = all(out[a]["match"] for a, _ in archs)
    return out


# ------------------------------------------------------------------------------------------- models
def build_throughput_model(dest: Path, dry: bool, device: str) -> dict:
    """A random-weight Qwen3-0.6B-shaped model (Qwen2-0.5B shape without Qwen3) saved at ``dest``, bf16."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llminfer.models.builtin import builtin_model_path

    arch = "qwen3" if hasattr(transformers, "Qwen3Config") else "qwen2"
    spec = dict(QWEN3_06B if arch == "qwen3" else QWEN2_05B)
    if dry:
        spec.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, **({"head_dim": 16} if arch == "qwen3" else {}))
    config_cls = transformers.Qwen3Config if arch == "qwen3" else transformers.Qwen2Config
    config = config_cls(**spec, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(builtin_model_path()).save_pretrained(dest)
    params = sum(p.numel() for p in model.parameters())
    del model
    free_memory()
    return {"architecture": arch, "parameters": params, **{k: spec[k] for k in ("hidden_size", "num_hidden_layers")}}


def nano_vllm_workload(dry: bool) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py recipe: 256 requests, prompt and output lengths uniform in 100..1024, seed 0."""
    rng = random.Random(0)
    num, lo, hi = (3, 2, 4) if dry else (256, 100, 1024)
    prompts = [[rng.randrange(10_000) for _ in range(rng.randint(lo, hi))] for _ in range(num)]
    outputs = [rng.randint(lo, hi) for _ in range(num)]
    return prompts, outputs


# ------------------------------------------------------------------------------------------- bandwidth
def copy_bandwidth(device: str, dry: bool, nbytes: int | None = None, reps: int | None = None) -> float:
    """Bytes read + written per second by ``Tensor.copy_`` of a 1 GiB buffer (16 MiB in a dry run; or
    ``nbytes``, ``reps`` times)."""
    n = nbytes or ((16 << 20) if dry else (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    reps = reps or (3 if dry else 20)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n * reps / (time.perf_counter() - t0)


def decode_bytes_per_step(model: torch.nn.Module, context: float) -> dict[str, float]:
    """Bytes one batch-1 decode step reads: every weight once (the input embedding only if it is not also
    the LM head: a lookup reads one row; a weight-only quantized layer's codes, scales and zero points) plus K
    and V of ``context`` tokens in every layer."""
    from llminfer.models.weight_only import WEIGHT_ONLY_TYPES

    seen, weight = set(), 0
    quantized = [t for m in model.modules() if isinstance(m, WEIGHT_ONLY_TYPES) for t in m.buffers(recurse=False)]
    for p in [*model.parameters(), *quantized]:
        if id(p) not in seen:
            seen.add(id(p))
            weight += p.numel() * p.element_size()
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if emb is not head:
        weight -= emb.numel() * emb.element_size()
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * emb.element_size() * context
    return {"weight_bytes": float(weight), "kv_bytes": float(kv), "total_bytes": float(weight + kv)}


def check_bandwidth(path: Path, device: str, dry: bool) -> dict:
    bw = copy_bandwidth(device, dry)
    prompt_len, new_tokens = (4, 3) if dry else (512, 256)
    rng = random.Random(3)
    prompts = [[rng.randrange(10_000) for _ in range(prompt_len)] for _ in range(1 if dry else 3)]
    out: dict[str, Any] = {"copy_bandwidth_bytes_per_s": bw, "prompt_tokens": prompt_len, "new_tokens": new_tokens}
    for graphs in (True,) if dry else (True, False):  # the dry run takes the loop once
        cfg = engine_config(path, device, "bfloat16", max_batch_size=1, max_model_len=1024, cuda_graphs=graphs,
                            max_tokens=1024, num_blocks=128)  # batch 1: 2k tokens of KV is plenty
        with load_engine(cfg, cpu_graphs=True) as engine:
            if not dry:
                engine.run(prompts[0], max_new_tokens=4, ignore_eos=True)  # warm-up
            tpot = []
            for p in prompts:
                st = engine.run(p, max_new_tokens=new_tokens, ignore_eos=True).stats
                tpot.append((st.total_latency_ms - st.ttft_ms) / max(1, st.completion_tokens - 1))
            step_ms = sorted(tpot)[len(tpot) // 2]
            moved = decode_bytes_per_step(engine.backend.model, prompt_len + new_tokens / 2)
        del engine  # a closed engine still holds its weights and KV pool until collected
        free_memory()
        out["graphs_on" if graphs else "graphs_off"] = {
            "step_ms": step_ms, **moved,
            "bandwidth_utilisation": moved["total_bytes"] / (step_ms / 1e3) / bw}
    if "graphs_off" in out:
        out["graphs_speedup_batch1"] = out["graphs_off"]["step_ms"] / out["graphs_on"]["step_ms"]
    return out


# ------------------------------------------------------------------------------------------- throughput
def run_llminfer(path: Path, device: str, dry: bool, prompts, outputs, graphs: bool) -> dict:
    cfg = engine_config(path, device, "bfloat16", max_batch_size=8 if dry else 256, max_model_len=2048,
                        cuda_graphs=graphs, max_tokens=64 if dry else 8192, num_blocks=256 if dry else None)
    with load_engine(cfg, cpu_graphs=True) as engine:
        if not dry:
            engine.run(prompts[0][:16], max_new_tokens=2, ignore_eos=True)  # warm-up
        requests = [engine.make_request(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, outputs)]
        t0 = time.perf_counter()
        results = engine.run_requests(requests)
        seconds = time.perf_counter() - t0
        info = engine.info()
    del engine, requests
    free_memory()
    tokens = sum(r.stats.completion_tokens for r in results)
    return {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "kv_blocks": info.get("kv_blocks"), "cuda_graphs": info.get("cuda_graphs")}


def load_hf(path: Path, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation="sdpa"
                                                ).to(device).eval()


def run_hf_static(path: Path, device: str, dry: bool, prompts, outputs) -> dict:
    """HF generate() in static batches of 64 (4 in a dry run), left-padded; each batch runs to its longest
    requested output, but only the tokens requested count."""
    model = load_hf(path, device)
    batch = 4 if dry else 64
    t0 = time.perf_counter()
    delivered = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ps, outs = prompts[i:i + batch], outputs[i:i + batch]
            width = max(map(len, ps))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
            n = max(outs)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=0)
            delivered += sum(outs)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del model
    free_memory()
    return {"output_tokens": delivered, "seconds": seconds, "tokens_per_s": delivered / seconds, "batch": batch}


def run_hf_continuous(path: Path, device: str, dry: bool, prompts, outputs) -> dict:
    """transformers' continuous batching manager, every request with its own max_new_tokens, EOS off."""
    from transformers import GenerationConfig

    model = load_hf(path, device)
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=-1, pad_token_id=0)
    extra: dict[str, Any] = {}
    if dry:  # transformers sizes its cache from free memory and captures graphs: too slow for a CPU test
        from transformers import ContinuousBatchingConfig

        extra = {"continuous_batching_config": ContinuousBatchingConfig(num_blocks=64), "warmup": False}
    delivered = 0
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5,
                                                   **extra) as manager:
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, outputs)]
        pending = set(ids)
        deadline = time.monotonic() + 600
        while pending and time.monotonic() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                pending.discard(result.request_id)
                delivered += len(result.generated_tokens)
    seconds = time.perf_counter() - t0
    del model
    free_memory()
    if pending:
        raise RuntimeError(f"{len(pending)} requests did not finish")
    return {"output_tokens": delivered, "seconds": seconds, "tokens_per_s": delivered / seconds}


def check_throughput(path: Path, device: str, dry: bool, budget: Budget) -> dict:
    prompts, outputs = nano_vllm_workload(dry)
    out: dict[str, Any] = {"num_requests": len(prompts), "requested_output_tokens": sum(outputs),
                           "prompt_tokens": sum(map(len, prompts))}
    section(out, "llminfer", budget, 30, run_llminfer, path, device, dry, prompts, outputs, True)
    section(out, "hf_continuous", budget, 60, run_hf_continuous, path, device, dry, prompts, outputs)
    section(out, "hf_static", budget, 60, run_hf_static, path, device, dry, prompts, outputs)
    if not dry:  # the same runner as above with one flag changed
        section(out, "llminfer_graphs_off", budget, 30, run_llminfer, path, device, dry, prompts, outputs, False)
    tps = {k: out.get(k, {}).get("tokens_per_s")
           for k in ("llminfer", "hf_static", "hf_continuous", "llminfer_graphs_off")}
    if tps["llminfer"]:
        for k in ("hf_static", "hf_continuous", "llminfer_graphs_off"):
            if tps[k]:
                out[f"ratio_llminfer_over_{k}"] = tps["llminfer"] / tps[k]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_check.json or bench/results/)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting sections after this")
    args = ap.parse_args(argv)
    configure_logging("warning")
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        raise SystemExit(2)
    budget = Budget(args.budget_s)
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    results: dict[str, Any] = {
        "check": "gpu_check", "dry_run": dry, "torch": torch.__version__, "transformers": transformers.__version__,
        "triton": triton_version,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "targets": {"batch1_bandwidth_utilisation": ">= 0.6", "ratio_llminfer_over_hf_static": ">= 3",
                    "ratio_llminfer_over_hf_continuous": ">= 1.5"},
    }
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        root = Path(tmp)
        section(results, "exactness", budget, 20, check_exactness, root, device, dry)
        model_dir = root / "throughput-model"
        section(results, "model", budget, 20, build_throughput_model, model_dir, dry, device)
        if "error" not in results["model"] and "skipped" not in results["model"]:
            section(results, "bandwidth", budget, 30, check_bandwidth, model_dir, device, dry)
            section(results, "throughput", budget, 60, check_throughput, model_dir, device, dry, budget)
    results["total_seconds"] = round(args.budget_s - budget.left(), 1)
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or HERE / "results") / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"-> {out}")
    return results


if __name__ == "__main__":
    main()
