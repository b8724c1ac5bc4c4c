"""Advanced features: decoding controls, speculative decoding, a LoRA adapter made on the spot, and
benchmark artifacts (JSON, CSV, PNG).

Runs offline on the built-in tiny model (random weights: meaningless text, so the point is the mechanics):

    python examples/advanced_features.py [--out DIR]

With a real model (e.g. --model Qwen/Qwen2.5-1.5B-Instruct and --assistant Qwen/Qwen2.5-0.5B-Instruct, which
share a tokenizer) the same calls give readable text and a high draft acceptance rate.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from llminfer import EngineConfig, InferenceEngine
from llminfer.benchmark import Benchmarker


def section(title: str) -> None:
    print(f"\n=== {title}")


def make_random_lora(base_model_dir: str, out_dir: Path, seed: int = 0) -> Path:
    """Save a LoRA adapter with random (non-zero) weights for the base model, with PEFT."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    lora = get_peft_model(base, LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "up_proj"],
                                           init_lora_weights=False))
    lora.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--assistant", default="builtin", help="draft model for speculative decoding")
    ap.add_argument("--out", default=None, help="folder for the benchmark artifacts")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="llminfer-advanced-"))
    summary: dict = {}

    engine = InferenceEngine(EngineConfig(model_name=args.model, max_batch_size=8)).load().start()
    prompt = "Write a list of ideas:"

    section("decoding controls")
    base = engine.run(prompt, max_new_tokens=24, ignore_eos=True)
    stop = base.generated_text[6:10]
    stopped = engine.run(prompt, max_new_tokens=24, ignore_eos=True, stop_sequences=[stop])
    print(f"stop at {stop!r}: {stopped.generated_text!r} (finish: {stopped.finish_reason})")
    ngram = engine.run(prompt, max_new_tokens=40, ignore_eos=True, no_repeat_ngram_size=2)
    ids = list(ngram.token_ids)
    print("no_repeat_ngram_size=2 → repeated bigrams:", len(ids) - 1 - len(set(zip(ids, ids[1:]))))
    banned_word = engine.tokenizer.decode([base.token_ids[0]]).strip()
    banned = engine.run(prompt, max_new_tokens=24, ignore_eos=True, bad_words=[banned_word])
    print(f"bad_words=[{banned_word!r}] → first token now {engine.tokenizer.decode([banned.token_ids[0]])!r}")
    forced = engine.run(prompt, max_new_tokens=12, force_words=["paged attention"])
    print(f"force_words → {forced.generated_text!r}")
    a = engine.run(prompt, max_new_tokens=8, temperature=0.9, top_p=0.95, seed=42).token_ids
    b = engine.run(prompt, max_new_tokens=8, temperature=0.9, top_p=0.95, seed=42).token_ids
    print("seed=42 twice gives the same tokens:", a == b)
    summary.update(stopped=stopped.finish_reason, seeded_equal=a == b,
                   forced="paged attention" in forced.generated_text)

    section("speculative decoding")
    spec = InferenceEngine(EngineConfig(model_name=args.model, assistant_model_name=args.assistant,
                                        speculative_num_assistant_tokens=4,
                                        speculative_confidence_threshold=0.0)).load()
    with spec:
        r = spec.run(prompt, max_new_tokens=24, ignore_eos=True)
    print(f"same greedy text as plain decoding: {r.token_ids == base.token_ids}; "
          f"draft acceptance {r.stats.spec_acceptance_rate:.0%}")
    summary["spec_identical"] = r.token_ids == base.token_ids

    section("a LoRA adapter made on the spot")
    adapter_dir = make_random_lora(engine.model_path, out / "random-lora")
    before = engine.run(prompt, max_new_tokens=12).token_ids
    engine.load_adapter(str(adapter_dir), adapter_name="demo")
    with_lora = engine.run(prompt, max_new_tokens=12).token_ids
    engine.unload_adapter("demo")
    after = engine.run(prompt, max_new_tokens=12).token_ids
    print(f"adapter changes the output: {with_lora != before}; unloading restores it: {after == before}")
    summary.update(lora_changes=with_lora != before, lora_restores=after == before)

    section("benchmark artifacts")
    bench = Benchmarker(engine, prompt_len=16).run(batch_sizes=[1, 2], num_runs=1, max_new_tokens=8)
    bench.print_summary()
    paths = bench.save_artifacts(out)
    pngs = bench.plot_suite(out, prefix="advanced")
    print("wrote:", paths["json"], paths["csv"], *pngs, sep="\n  ")
    engine.close()
    summary["artifacts"] = [str(paths["json"]), str(paths["csv"]), *map(str, pngs)]
    return summary


if __name__ == "__main__":
    main()
