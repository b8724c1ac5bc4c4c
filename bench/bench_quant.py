"""Weight-only quantization on CPU: batch-1 decode ms/token of fp32 vs int8-wo vs int4-wo, side by side in
one run, with weight bytes and the accuracy against fp32.

Model: the ~102M Qwen2-shaped benchmark model (random weights, tied embeddings: 78M parameters in the
embedding, read every step as the LM head) loaded in float32; the quantized rows quantize every linear
layer and the LM head (``quantize_lm_head``, the default; int4-wo's head in int8, ``QuantConfig.int4_lm_head``).
int8-wo runs on llminfer's CPU kernel where it builds (:mod:`llminfer.kernels.build`: fp32
activations, or 14-bit integer ones on AVX-512 VNNI); int4-wo on llminfer's kernel where it has VNNI
(14-bit activations), else on torch's (bf16 activations). The accuracy has one more row,
``int4-wo-int4-head``: every layer and the head in int4.

int8-wo runs in its default format (groups of 32, ``int8_group_size=32``) and per output channel
(``int8-wo-channel``, ``int8_group_size=0``). Each int8 format and int4-wo run on both kernel paths, the q8 path
(``int8-wo:q8``, ``int8-wo-channel:q8``, ``int4-wo:q8``: 8-bit activations per 32 columns, u8 x s8 dot
products) and the wide one (``...:wide``: 14-bit activations), forced with ``LLMINFER_CPU_KERNEL_INT8_PATH`` /
``_INT4_PATH`` at load; the rounds visit all of them in turn, and the plain ``int8-wo`` / ``int8-wo-channel`` /
``int4-wo`` keys repeat the figures of the path ``quant_paths`` chose here.

Speed: one request at a time (batch 1), a 32-token prompt, greedy, EOS ignored; ms/token is the engine's
time per output token after the first (``(total_latency_ms - ttft_ms) / (tokens - 1)``), the median over ``--reps`` rounds that
visit the modes in turn (so a load change on the machine hits all of them alike).

Accuracy (``llminfer.models.agreement.logit_agreement``): teacher-forced over the bench prompts, the
fraction of positions where the quantized model's argmax equals fp32's, and the logit error. Random
weights give nearly flat logits, so top-1 flips wherever the fp32 top-1/top-2 margin is below the
quantization error (``mean_ref_top2_margin`` against ``mean_abs_err`` shows how close that is); the
``bf16`` row (the unquantized model in bfloat16) is the yardstick of a precision change users accept.

Weight bytes: with tied embeddings the input embedding keeps its fp32 weight for the token lookup, and the
quantized head is an extra copy, so the footprint barely shrinks; what a decode step reads
(``weight_bytes_read_per_step``) drops by ~4x (int8) and ~6x (int4).

With ``--model NAME`` (a trained model: a folder, a .gguf file or a built-in name; ``run_all.py`` passes
``common.TRAINED_MODEL``), the same rows on that model, written to results/quant_trained.json: the speed
prompt is the first 32 tokens of ``common.ENGLISH_PASSAGES``, the accuracy text those passages (each a
teacher-forced sequence), and two bitsandbytes rows join the accuracy (``nf4`` and LLM.int8 ``int8``, fp32
compute, every linear layer but the LM head, where bitsandbytes runs). On trained weights the fp32 top-1/top-2
margins are wide, so top-1 agreement measures the quantization, not the noise of flat logits. When the
trained model came from a GGUF file (the built-in SmolLM2-135M-Instruct is Q4_1), the fp32 reference *is*
that GGUF's quantization, dequantized: "the GGUF's own quantization against fp32" is the identity here, and
``int4-wo`` (asymmetric groups of 32 along the input, ``min + q * scale``: Q4_1's grid) re-quantizes Q4_1
weights almost losslessly; what it then differs by is the activation precision of the kernels. llama.cpp's
figures on the same file come from ``bench/llamacpp/peer.py --gguf``.

    nice python bench/bench_quant.py [--quick] [--reps 3] [--new-tokens 48] [--model NAME]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics

import torch

from common import (
    BENCH_VOCAB,
    ENGLISH_PASSAGES,
    bench_model_path,
    environment,
    load_hf_model,
    random_prompts,
    resolve_trained,
    save,
    skip_payload,
)
from llminfer import CacheConfig, EngineConfig, InferenceEngine, QuantConfig
from llminfer.kernels import build, path_choice
from llminfer.logging import configure_logging
from llminfer.models.agreement import logit_agreement, sequence_logits
from llminfer.models.kernel_swap import enable_cpu_kernels
from llminfer.models.weight_only import quantize_model

#: (variant, mode, kernel path): every quantized mode on both paths of llminfer's CPU kernel.
#: (key, mode, forced kernel path, int8 group size): int8-wo in its default groups of 32 and per output channel
#: (``int8_group_size=0``), and int4-wo, each on both kernel paths.
VARIANTS = (("none", "none", None, 32), ("int8-wo:q8", "int8-wo", "q8", 32), ("int8-wo:wide", "int8-wo", "wide", 32),
            ("int8-wo-channel:q8", "int8-wo", "q8", 0), ("int8-wo-channel:wide", "int8-wo", "wide", 0),
            ("int4-wo:q8", "int4-wo", "q8", 32), ("int4-wo:wide", "int4-wo", "wide", 32))


class _forced_paths:
    """Forces both quantized kernel paths to ``path`` (None: the measured choice) while a model is loaded."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in (path_choice.INT8_PATH_ENV, path_choice.INT4_PATH_ENV)}
        for k in self.saved:
            os.environ[k] = self.path or "auto"

    def __exit__(self, *exc) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _engine(path, mode: str, group_size: int, kernel_path: str | None = None, int8_group_size: int = 32
            ) -> InferenceEngine:
    with _forced_paths(kernel_path):
        return _engine_now(path, mode, group_size, int8_group_size)


def _engine_now(path, mode: str, group_size: int, int8_group_size: int = 32) -> InferenceEngine:
    cfg = EngineConfig(model_name=str(path), dtype="float32", device="cpu", max_batch_size=1, batch_timeout_ms=0,
                       cache=CacheConfig(page_size_tokens=16, kv_cache_memory_bytes=64 << 20),
                       quant=QuantConfig(mode=mode, int4_group_size=group_size, int8_group_size=int8_group_size))
    return InferenceEngine(cfg).load()


def step_weight_bytes(model, weight_bytes: int) -> int:
    """Weight bytes one decode step reads: all of them, less the input embedding when the LM head does not
    share it (a lookup reads one row; a quantized tied head is a separate, smaller copy)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if getattr(head, "weight", None) is emb:
        return weight_bytes
    return weight_bytes - emb.numel() * emb.element_size()


def bnb_accuracy(path, ref_logits: list[torch.Tensor], prompts: list[list[int]]) -> dict[str, dict[str, float]]:
    """bitsandbytes ``nf4`` and ``int8`` (LLM.int8) against fp32 logits, loaded as llminfer loads them
    (:func:`llminfer.models.quant.bnb_config`, fp32 compute); one ``SKIP:`` line per mode that cannot run."""
    from transformers import AutoConfig

    from llminfer.errors import LLMInferError
    from llminfer.models.quant import bnb_config

    config = AutoConfig.from_pretrained(str(path)) if path.is_dir() else None
    if config is not None and getattr(config, "quantization_config", None) is not None:
        # A folder saved from a dequantized GGUF keeps its GgufConfig, which transformers will not replace
        # by a BitsAndBytesConfig; the weights in it are plain floats.
        del config.quantization_config
    out = {}
    for mode in ("nf4", "int8"):
        try:
            qcfg = bnb_config(QuantConfig(mode=mode, compute_dtype="float32"), torch.device("cpu"))
            kw = {"config": config} if config is not None else {}
            model = load_hf_model(path, dtype=torch.float32, attn_implementation="sdpa", quantization_config=qcfg,
                                  **kw)
        except (LLMInferError, ImportError, RuntimeError, ValueError) as exc:
            print(f"SKIP: bitsandbytes {mode}: {str(exc).splitlines()[0][:200]}")
            continue
        out[f"bnb-{mode}"] = logit_agreement(ref_logits, model, prompts)
        del model
    return out


def accuracy(path, prompts: list[list[int]], group_size: int, bnb: bool = False) -> dict[str, dict[str, float]]:
    """Teacher-forced agreement and logit error of each quantized mode against fp32, over ``prompts``
    (with ``bnb``, bitsandbytes' modes too)."""
    ref = load_hf_model(path, dtype=torch.float32, attn_implementation="sdpa")
    ref_logits = sequence_logits(ref, prompts)
    out = {"bf16": logit_agreement(ref_logits, copy.deepcopy(ref).to(torch.bfloat16), prompts)}
    runs = [(v, m, "int8", p, g) for v, m, p, g in VARIANTS[1:]] + [("int4-wo-int4-head", "int4-wo", "int4", None, 32)]
    for name, mode, head, kernel_path, int8_group_size in runs:
        model = copy.deepcopy(ref)
        quantize_model(model, mode, group_size=group_size, int4_lm_head=head, int8_group_size=int8_group_size)
        with _forced_paths(kernel_path):
            enable_cpu_kernels(model)  # as the engine runs them: llminfer's CPU kernels where they build
        out[name] = logit_agreement(ref_logits, model, prompts)
        del model
    if bnb:
        out.update(bnb_accuracy(path, ref_logits, prompts))
    return out


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 16 tokens, 2 accuracy prompts")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--group-size", type=int, default=32, help="int4 group size")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--model", default=None, help="a trained model (folder, .gguf or built-in name) instead of "
                    "the random bench model; writes results/quant_trained.json")
    args = ap.parse_args()
    reps, new = (2, 16) if args.quick else (args.reps, args.new_tokens)
    configure_logging("warning")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    if args.model:
        try:
            path = resolve_trained(args.model)
        except (FileNotFoundError, OSError) as exc:
            return skip_payload("quant_trained", str(exc))
    else:
        path = bench_model_path()
    engines = {v: _engine(path, m, args.group_size, p, g) for v, m, p, g in VARIANTS}
    facts = {v: e.info() for v, e in engines.items()}
    if args.model:
        tok = engines["none"].tokenizer
        passages = [tok.encode(text, add_special_tokens=False) for text in ENGLISH_PASSAGES]
        prompt = passages[0][:32]
        acc_prompts = passages[:2] if args.quick else passages
    else:
        prompt = random_prompts(1, 32, BENCH_VOCAB, seed=11)[0]
        acc_prompts = random_prompts(2 if args.quick else 4, 64, BENCH_VOCAB, seed=12)
    read_bytes = {v: step_weight_bytes(e.model, facts[v]["weight_bytes"]) for v, e in engines.items()}
    for e in engines.values():
        e.run(prompt, max_new_tokens=4, ignore_eos=True)  # warm-up
    tpot: dict[str, list[float]] = {v: [] for v in engines}
    tokens: dict[str, list[int]] = {}
    for _ in range(reps):
        for v, e in engines.items():
            r = e.run(prompt, max_new_tokens=new, ignore_eos=True)
            st = r.stats
            tpot[v].append((st.total_latency_ms - st.ttft_ms) / max(st.completion_tokens - 1, 1))
            tokens[v] = list(r.token_ids)
    for e in engines.values():
        e.close()
    acc = accuracy(path, acc_prompts, args.group_size, bnb=bool(args.model))
    chosen = {k: v["path"] for k, v in path_choice.quant_paths().items()} if build.skinny_linear_available() \
        else {"int8": "wide", "int8-group": "wide", "int4": "wide"}
    for m, kind in (("int8-wo", "int8-group"), ("int8-wo-channel", "int8"), ("int4-wo", "int4")):
        v = f"{m}:{chosen[kind]}"  # the plain keys: the path chosen here
        for d in (tpot, tokens, facts, read_bytes, acc):
            d[m] = d[v]
    ms = {m: statistics.median(v) for m, v in tpot.items()}

    def same_prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    payload = {
        "benchmark": "weight_only_quant", "model": str(path), "dtype": "float32", "batch_size": 1,
        "prompt_tokens": len(prompt), "new_tokens": new, "reps": reps, "int4_group_size": args.group_size,
        "torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "decode_ms_per_token": ms, "decode_ms_per_token_runs": tpot,
        "speedup_vs_fp32": {m: ms["none"] / v for m, v in ms.items()},
        "weight_bytes": {m: f["weight_bytes"] for m, f in facts.items()},
        "quantized_linear_bytes": {m: f.get("quantized_linear_bytes", 0) for m, f in facts.items()},
        "weight_bytes_read_per_step": read_bytes,
        "accuracy_teacher_forced": acc,
        "greedy_tokens_identical_to_fp32": {m: same_prefix(tokens[m], tokens["none"]) for m in tokens if m != "none"},
        "kernel_paths_chosen": chosen,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "environment": environment(),
    }
    b = acc["bf16"]
    print(f"[quant] (unquantized bf16 vs fp32: top-1 agree {b['top1_agreement']:.1%}, rel err {b['rel_err']:.3f}; "
          f"fp32 mean top-1/top-2 margin {b['mean_ref_top2_margin']:.3f})")
    for m in [v for v, *_ in VARIANTS]:
        a = acc.get(m)
        extra = (f"  top-1 agree {a['top1_agreement']:.1%} over {a['positions']}  rel err {a['rel_err']:.3f}  "
                 f"greedy same for {payload['greedy_tokens_identical_to_fp32'][m]}/{new}") if a else ""
        print(f"[quant] {m:20s} {ms[m]:7.2f} ms/token  x{payload['speedup_vs_fp32'][m]:.2f}  "
              f"weights {facts[m]['weight_bytes'] / 1e6:6.1f} MB (read per step {read_bytes[m] / 1e6:6.1f} MB){extra}")
    print(f"[quant] paths chosen here: {chosen}")
    for name in ["int4-wo-int4-head", *(k for k in acc if k.startswith("bnb-"))]:
        a = acc[name]
        print(f"[quant] {name}: top-1 agree {a['top1_agreement']:.1%} over {a['positions']}  "
              f"rel err {a['rel_err']:.3f}")
    print(f"[quant] load average before {load_before[0]:.2f}, after {payload['load_average_after'][0]:.2f}; "
          f"{payload['torch_threads']} torch threads, {payload['cpu_capability']}")
    saved = save("quant_trained", payload) if args.model else save("quant", payload)
    print(f"-> {saved}")
    return payload


if __name__ == "__main__":
    main()
