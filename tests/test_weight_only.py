"""Weight-only int8 / int4 quantization on torch's CPU kernels (``--quant int8-wo|int4-wo``).

The quantized layers equal the matmul with their dequantized weight up to float rounding (a packing or
layout mistake breaks that by orders of magnitude); the model's teacher-forced top-1 agreement with fp32
stays within documented bounds; the engine's paged-KV / prefix-cache / speculative / LoRA paths give the
same tokens as Hugging Face ``generate()`` on the same quantized model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from helpers import make_engine, random_prompts
from llminfer import ConfigError, QuantConfig, QuantMode
from llminfer.cli import main
from llminfer.kernels import path_choice
from llminfer.logging import reset_logging
from llminfer.models.agreement import logit_agreement, sequence_logits
from llminfer.models.kernel_swap import enable_cpu_kernels
from llminfer.models.quant import check_weight_only_supported
from llminfer.models.weight_only import (
    Int4WeightOnlyLinear,
    Int8GroupWeightOnlyLinear,
    Int8WeightOnlyLinear,
    dequantize_int4,
    quantize_int4_groupwise,
    quantize_model,
)

VOCAB = 151_000


@pytest.fixture(autouse=True)
def _reset_logging():
    """In-process CLI runs bind structlog to the captured stderr, closed after the test: reset it."""
    yield
    reset_logging()


def _linear(n_in: int, n_out: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out)
    with torch.no_grad():
        lin.weight[3] = 0.0  # an all-zero output channel must not divide by a zero scale
    return lin


@pytest.fixture(scope="module")
def hf_fp32(qwen2_dir) -> nn.Module:
    """The fp32 HF model of ``qwen2_dir`` (loaded once; tests quantize deep copies)."""
    return AutoModelForCausalLM.from_pretrained(str(qwen2_dir), dtype=torch.float32, attn_implementation="sdpa").eval()


# ------------------------------------------------------------------------------------------ layers
@torch.inference_mode()
def test_int8_layer_equals_dequantized_matmul():
    lin = _linear(96, 40, seed=0)
    x = torch.randn(3, 5, 96)
    exact = Int8WeightOnlyLinear(lin, compute_dtype=torch.float32)
    deq = exact.dequantized_weight()
    # Per-channel rounding: every weight within half a step of its channel's scale.
    assert ((deq - lin.weight).abs() <= exact.scales[:, None] / 2 + 1e-7).all()
    torch.testing.assert_close(exact(x), F.linear(x, deq, lin.bias), rtol=1e-5, atol=1e-5)
    # The bf16 (vectorized) kernel: bf16-rounded input, fp32 accumulation, bf16-rounded product.
    fast = Int8WeightOnlyLinear(lin)
    assert fast.weight.dtype == torch.int8 and fast.scales.dtype == torch.bfloat16
    want = (x.bfloat16().float() @ fast.dequantized_weight().t()).bfloat16().float() + lin.bias
    torch.testing.assert_close(fast(x), want, rtol=1e-2, atol=1e-2)
    assert fast(x).dtype == torch.float32 and fast(x).shape == (3, 5, 40)


@pytest.mark.parametrize("group_size", [32, 64])
@torch.inference_mode()
def test_int4_layer_equals_dequantized_matmul(group_size):
    lin = _linear(128, 40, seed=1)  # 40 outputs: padded to 48 for the kernel, sliced back
    x = torch.randn(7, 128)
    q, sz = quantize_int4_groupwise(lin.weight, group_size)
    deq = dequantize_int4(q, sz, group_size)
    assert q.min() >= 0 and q.max() <= 15
    assert ((deq - lin.weight).abs() <= sz[..., 0].t().repeat_interleave(group_size, 1) / 2 + 1e-6).all()
    exact = Int4WeightOnlyLinear(lin, group_size, compute_dtype=torch.float32)
    torch.testing.assert_close(exact(x), F.linear(x, deq, lin.bias), rtol=1e-5, atol=1e-5)
    fast = Int4WeightOnlyLinear(lin, group_size)
    torch.testing.assert_close(fast(x), F.linear(x, deq, lin.bias), rtol=3e-2, atol=3e-2)
    assert fast.weight.dtype == torch.uint8 and fast(x).shape == (7, 40)


def test_quantize_model_tied_head_keeps_embedding_and_reports_skips(qwen2_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(qwen2_dir))
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    emb = model.get_input_embeddings().weight
    assert model.lm_head.weight is emb
    before = emb.detach().clone()
    report = quantize_model(copy.deepcopy(model), "int8-wo", quantize_lm_head=False)
    assert "lm_head" in report["skipped"]
    report = quantize_model(model, "int8-wo")
    assert "lm_head" in report["quantized"] and not report["skipped"]
    assert isinstance(model.lm_head, Int8GroupWeightOnlyLinear) and model.lm_head.tied_to_input_embedding
    assert model.get_input_embeddings().weight is emb and torch.equal(emb, before)  # the lookup is unchanged
    ids = torch.tensor([[5, 9, 100]])
    torch.testing.assert_close(model.get_input_embeddings()(ids), before[ids])
    # int4 with groups wider than the 64-wide inputs: the layers that do not fit stay float, with a reason.
    r4 = quantize_model(AutoModelForCausalLM.from_config(cfg), "int4-wo", group_size=128)
    assert r4["skipped"] and all("% 128 == 0" in why for why in r4["skipped"].values())


def test_int4_keeps_an_int8_head_unless_asked(hf_fp32):
    """``int4-wo`` quantizes the LM head to int8 by default, to 6 bits with ``int4_lm_head="int6"`` where
    llminfer's kernel loads (llama.cpp's Q4_0 keeps its output matrix at Q6_K; int8 where it does not), to int4
    with ``"int4"``; the other layers are int4 either way; a bad value is a ConfigError naming the field."""
    from llminfer.kernels.int8_group_linear import kernel_available
    from llminfer.models.weight_only_int6 import Int6GroupWeightOnlyLinear

    default, six, four = copy.deepcopy(hf_fp32), copy.deepcopy(hf_fp32), copy.deepcopy(hf_fp32)
    quantize_model(default, "int4-wo")
    quantize_model(six, "int4-wo", int4_lm_head="int6")
    quantize_model(four, "int4-wo", int4_lm_head="int4")
    assert isinstance(default.lm_head, Int8GroupWeightOnlyLinear) and isinstance(four.lm_head, Int4WeightOnlyLinear)
    assert isinstance(six.lm_head, Int6GroupWeightOnlyLinear if kernel_available() else Int8GroupWeightOnlyLinear)
    layers = [m for n, m in default.named_modules() if n.endswith("mlp.down_proj")]
    assert layers and all(isinstance(m, Int4WeightOnlyLinear) for m in layers)
    assert QuantConfig(mode="int4-wo").int4_lm_head == "int8"
    assert QuantConfig(mode="from-gguf", int4_lm_head="int6").int4_lm_head == "int6"
    for mode in ("int8-wo", "none"):  # a head format the mode does not have is an error, not ignored
        with pytest.raises(ConfigError, match="int4_lm_head 'int6' applies to int4-wo"):
            QuantConfig(mode=mode, int4_lm_head="int6")
    with pytest.raises(ConfigError, match="int4_lm_head"):
        QuantConfig(mode="int4-wo", int4_lm_head="int2")


def test_teacher_forced_agreement_with_fp32(hf_fp32):
    """Random weights give near-flat logits (mean top-1/top-2 margin ~0.04 here), so top-1 flips wherever
    the margin is below the quantization error: int8 (per-channel, bf16 activations) measured 0.957 over
    these 256 positions on an AVX2 CPU, int4 (groups of 32) 0.76. The bounds leave a few flips of room (a CPU
with native bf16 runs other kernels, with other rounding); the relative logit error is the steadier check."""
    ref = hf_fp32
    seqs = random_prompts([64, 64, 64, 64], VOCAB, seed=1)
    q8, q4 = copy.deepcopy(ref), copy.deepcopy(ref)
    quantize_model(q8, "int8-wo")
    quantize_model(q4, "int4-wo", group_size=32, int4_lm_head="int4")  # every layer int4: the coarse bound
    ref_logits = sequence_logits(ref, seqs)
    a8, a4 = logit_agreement(ref_logits, q8, seqs), logit_agreement(ref_logits, q4, seqs)
    assert a8["positions"] == 256
    assert a8["top1_agreement"] >= 0.93 and a8["rel_err"] < 0.02
    assert a4["top1_agreement"] >= 0.65 and a4["rel_err"] < 0.2
    assert a4["mean_abs_err"] > a8["mean_abs_err"] > 0  # 4 bits are coarser than 8; both really quantize


# ------------------------------------------------------------------------------------------ engine
def _hf_greedy(model: nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def int8_case(hf_fp32):
    """Prompts (the third shares 8 tokens = 2 blocks with the first) and HF ``generate()``'s greedy tokens
    on the int8-wo copy of the fp32 model."""
    base = random_prompts([13, 30], VOCAB, seed=7)
    prompts = [base[0], base[1], base[0][:8] + base[1][:9]]
    hf = copy.deepcopy(hf_fp32)
    quantize_model(hf, "int8-wo")
    enable_cpu_kernels(hf)  # as the engine runs it: llminfer's CPU kernel (fp32 activations) where it builds
    return prompts, _hf_greedy(hf, prompts, 8)


@pytest.fixture(scope="module")
def int8_engine(qwen2_dir):
    """One int8-wo engine for the tests below (the LoRA test unloads its adapter)."""
    with make_engine(qwen2_dir, quant=QuantConfig(mode=QuantMode.INT8_WO)) as engine:
        yield engine


def test_engine_matches_hf_on_the_quantized_model_with_prefix_cache(int8_engine, hf_fp32, int8_case):
    """Paged KV and prefix caching on quantized layers: token for token what HF ``generate()`` gives on
    the same quantized model, cold and with cached prefixes. int8 only: int4 layers go through the same
    module path (their products are checked above)."""
    prompts, want = int8_case
    engine = int8_engine
    first = engine.run_batch_continuous(prompts, max_new_tokens=8, ignore_eos=True)
    again = engine.run_batch_continuous(prompts, max_new_tokens=8, ignore_eos=True)
    assert engine.cache_stats()["blocks_used"] == 0
    assert isinstance(engine.model.lm_head, Int8GroupWeightOnlyLinear)
    facts = engine.info()
    assert [list(r.token_ids) for r in first] == want
    assert [list(r.token_ids) for r in again] == want
    assert all(r.stats.cached_tokens > 0 for r in again)
    # int8-wo: a byte per weight plus a scale and a minimum per group of 32 (2 bytes each in the q8 layout, 4 on
    # the wide path), against 2 bytes per weight in bf16.
    assert facts["quant"] == "int8-wo"
    assert 0.56 <= facts["quantized_linear_bytes"] / facts["quantized_linear_bf16_bytes"] <= 0.64
    assert facts["weight_bytes"] < facts["weight_bytes_unquantized"]
    assert facts["parameters"] == sum(p.numel() for p in hf_fp32.parameters())
    # the CPU kernel line names the int8 path this build runs
    from llminfer.kernels import build

    if build.skinny_linear_available():
        from llminfer.kernels.path_choice import quant_paths

        q8 = quant_paths()["int8-group"]["path"] == "q8"
        assert f"int8_group_linear{'_q8' if q8 else ''} on" in facts["cpu_kernel"], facts["cpu_kernel"]
        assert "int8 in groups of 32 on integer dot products, " + (
            "activations as two 8-bit digits" if q8 else "14-bit activations") in facts["cpu_kernel"]
        assert engine.model.lm_head.kernel_path == ("q8" if q8 else "wide")


def test_int4_engine_runs_on_the_kernel_and_its_rows_do_not_depend_on_the_batch(qwen2_dir):
    """int4-wo with llminfer's kernel (where the CPU has AVX-512 VNNI): ``info`` names int4_linear and the
    int8 head, and greedy output of a request alone equals its output in a batch with others (the int4 and
    int8 products are batch-invariant, like the rest of the fp32 step)."""
    from llminfer.kernels import build

    # No prefix cache: a cache hit recomputes a prompt's last token against cached K/V, which is not bit-equal to
    # the full prefill, and 8-bit activations (the q8 path) turn such last-bit differences into other tokens.
    with make_engine(qwen2_dir, max_batch_size=8, prefix_cache=False, quant=QuantConfig(mode="int4-wo")) as engine:
        line = engine.info()["cpu_kernel"]
        if build.skinny_linear_available():
            paths = path_choice.quant_paths()
            # the int8 head takes int8-wo's group format, on the path chosen for it
            head = f"int8_group_linear{'_q8' if paths['int8-group']['path'] == 'q8' else ''} (groups of 32)"
            if paths["int4"]["path"] == "q8":
                assert line.startswith("int4_group_linear_q8 on ") and "int4 on the q8 path" in line, line
            elif build.int8_activation_bits():
                assert line.startswith("int4_linear on ") and "int4 on the wide path" in line, line
            if paths["int4"]["path"] == "q8" or build.int8_activation_bits():
                assert f"the LM head in int8 on {head};" in line, line
        prompts = random_prompts([5, 9, 14, 3, 20, 7], VOCAB, seed=4)
        alone = [list(engine.run(p, max_new_tokens=8, ignore_eos=True).token_ids) for p in prompts[:3]]
        together = engine.run_requests([engine.make_request(p, max_new_tokens=8, ignore_eos=True) for p in prompts])
        assert [list(r.token_ids) for r in together[:3]] == alone


def test_cli_info_formats_every_byte_count(qwen2_dir, capsys):
    main(["info", "--model", str(qwen2_dir), "--device", "cpu", "--quant", "int8-wo"])
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    for key in ("weight_bytes", "weight_bytes_unquantized", "quantized_linear_bytes"):
        assert " bytes (" in lines[key] and "MiB)" in lines[key], lines[key]


def test_speculative_with_quantized_target_and_draft(qwen2_dir, int8_case):
    """The quantized target drafting for itself (the draft is loaded with the same quant mode): greedy
    output equals HF ``generate()`` on the quantized model, every draft token is accepted."""
    prompts, want = int8_case
    with make_engine(qwen2_dir, quant=QuantConfig(mode="int8-wo"), assistant_model_name=str(qwen2_dir),
                     speculative_num_assistant_tokens=4, speculative_confidence_threshold=0.0) as engine:
        assert isinstance(engine.runtime.draft_model.lm_head, Int8GroupWeightOnlyLinear)
        spec = engine.run_batch_continuous(prompts, max_new_tokens=8, ignore_eos=True)
    assert [list(r.token_ids) for r in spec] == want
    assert all(r.stats.spec_acceptance_rate == 1.0 for r in spec)


def test_lora_on_the_quantized_base_matches_peft(int8_engine, hf_fp32, tmp_path):
    """PEFT wraps the quantized layers (they are ``nn.Linear`` subclasses): the LoRA product runs in fp32
    on top of the int8 base, as PEFT's own model on the same quantized base computes it."""
    peft = pytest.importorskip("peft", reason="PEFT is not installed (pip install 'llminfer[peft]')")
    torch.manual_seed(4)
    lora = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                           init_lora_weights=False)
    peft.get_peft_model(copy.deepcopy(hf_fp32), lora).save_pretrained(str(tmp_path / "a"))
    prompt = random_prompts([11], VOCAB, seed=8)
    base = copy.deepcopy(hf_fp32)
    quantize_model(base, "int8-wo")
    enable_cpu_kernels(base)
    want = _hf_greedy(peft.PeftModel.from_pretrained(base, str(tmp_path / "a")).eval(), prompt, 8)
    int8_engine.load_adapter(str(tmp_path / "a"), "a")
    try:
        got = int8_engine.run(prompt[0], max_new_tokens=8, ignore_eos=True).token_ids
    finally:
        int8_engine.unload_adapter("a")
    assert list(got) == want[0]


# ------------------------------------------------------------------------------------- config, CLI
def test_config_and_device_errors():
    assert QuantConfig(mode="int4-wo").mode is QuantMode.INT4_WO and QuantMode.INT8_WO.weight_only
    assert not QuantMode.INT8.weight_only
    with pytest.raises(ConfigError, match="int4_group_size"):
        QuantConfig(mode="int4-wo", int4_group_size=48)
    with pytest.raises(ConfigError, match="CPU only"):
        check_weight_only_supported(QuantConfig(mode="int8-wo"), torch.device("cuda"))


def test_cli_offers_the_weight_only_modes(capsys):
    main(["run", "--help"])
    out = "".join(capsys.readouterr().out.split())  # the choice list may wrap at the terminal's width
    assert "<auto|none|nf4|fp4|int8|int8-wo|int4-wo|from-gguf>" in out


@pytest.mark.skipif(not __import__("llminfer.kernels.int8_group_linear", fromlist=["x"]).kernel_available(),
                    reason="llminfer's CPU kernel does not build here")
@pytest.mark.parametrize("mode", ["int8-wo", "int4-wo"])
def test_structured_output_on_a_quantized_head_in_the_blocked_kernel_layout(qwen2_dir, monkeypatch, mode):
    """The grammar's bitmask is as wide as the logits, whatever the head's weight layout: on the q8 kernel path
    an int8-wo head's weight is [ceil(V / L), ...], not [V, ...]."""
    from llminfer.sampling.structured import StructuredOutput

    monkeypatch.setenv("LLMINFER_CPU_KERNEL_INT8_PATH", "q8")
    monkeypatch.setenv("LLMINFER_CPU_KERNEL_INT4_PATH", "q8")
    with make_engine(qwen2_dir, quant=QuantConfig(mode=mode)) as engine:
        head = engine.model.get_output_embeddings()
        assert head.kernel_path == "q8" and head.weight.shape[0] != head.out_features
        result = engine.run("Is the sky blue?", max_new_tokens=8, temperature=1.0, seed=0,
                            structured_output=StructuredOutput(choice=["yes", "no"]))
        assert result.text in ("yes", "no")
        assert engine.cache_stats()["blocks_used"] == 0


def test_kept_int4_grids_are_dropped_and_the_log_line_names_int4_wo_format():
    """A float32 grid kept for llminfer's kernel (``_kernel_grid``: groups whose bfloat16 zero point is not the
    quantizer's) is freed by ``drop_kernel_grids`` where the kernels do not take the layer; the quantization
    log line gives int4-wo's group size and head, not int8-wo's format."""
    import structlog

    from llminfer.logging import configure_logging
    from llminfer.models.quant import apply_weight_only
    from llminfer.models.weight_only import drop_kernel_grids

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16))
    with torch.no_grad():
        for layer in model:
            layer.weight.add_(1.0)  # groups away from 0: their zero points are no bfloat16 values
    configure_logging("info")  # the line is at info level; the autouse fixture resets logging after the test
    with structlog.testing.capture_logs() as logs:
        apply_weight_only(model, QuantConfig(mode=QuantMode.INT4_WO, int4_lm_head="int6"))
    line = next(e for e in logs if e["event"] == "weight-only quantization")
    assert line["int4_group_size"] == 32 and line["lm_head"] == "int6" and "int8_format" not in line
    assert all(m._kernel_grid is not None for m in model)
    drop_kernel_grids(model)
    assert all(m._kernel_grid is None for m in model)
