"""The oneDNN-prepacked LM head: same values as the plain one, never stale, used only where it applies."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import make_engine
from llminfer.kernels.prepack import PrepackedLinear, prepack_lm_head, prepack_supported
from llminfer.models import builtin_model_path

needs_bf16 = pytest.mark.skipif(not prepack_supported(torch.bfloat16, torch.device("cpu")),
                                reason="this CPU's oneDNN has no bf16 matmul")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_prepacked_linear_equals_linear(rows):
    torch.manual_seed(0)
    linear = nn.Linear(64, 1000, bias=False).to(torch.bfloat16)
    packed = PrepackedLinear(linear)
    x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight), atol=1e-2, rtol=1e-2)
    assert packed.weight is linear.weight  # tied embeddings stay tied


@needs_bf16
def test_prepacked_weight_is_rebuilt_after_in_place_change():
    linear = nn.Linear(16, 32, bias=True).to(torch.bfloat16)
    packed = PrepackedLinear(linear)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = packed(x)
    with torch.no_grad():
        linear.weight.mul_(2)
    with torch.inference_mode():
        after = packed(x)
    torch.testing.assert_close(after, F.linear(x, linear.weight, linear.bias), atol=1e-2, rtol=1e-2)
    assert not torch.allclose(before, after)


def test_other_dtypes_and_autograd_use_the_plain_weight():
    linear = nn.Linear(8, 4)
    packed = PrepackedLinear(linear)
    x = torch.randn(2, 8, requires_grad=True)  # autograd on: the plain F.linear, never the packed copy
    packed(x).sum().backward()
    assert x.grad is not None and packed._packed is None
    assert not prepack_lm_head(nn.Sequential())  # no output embedding: left alone


@needs_bf16
def test_engine_prepacks_bf16_and_fp32_cpu_heads():
    with make_engine(builtin_model_path(), dtype="bfloat16") as bf16, \
            make_engine(builtin_model_path()) as fp32:
        assert bf16.runtime.lm_head_prepacked and isinstance(bf16.model.get_output_embeddings(), PrepackedLinear)
        assert fp32.runtime.lm_head_prepacked  # fp32: oneDNN's packed matmul (MKL's fp32 GEMM is slow on AMD CPUs)
        assert bf16.run("Hello there", max_new_tokens=5).stats.completion_tokens == 5


def test_script_that_forgets_close_or_raises_still_exits(tmp_path):
    """A started engine's event loop must not keep the interpreter from exiting."""
    script = tmp_path / "forget.py"
    script.write_text(textwrap.dedent("""
        from llminfer import EngineConfig, InferenceEngine
        engine = InferenceEngine(EngineConfig(device="cpu"))
        engine.run("hi", max_new_tokens=2)
        raise ValueError("user bug")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "user bug" in proc.stderr


@needs_bf16
def test_lora_on_a_prepacked_head_matches_the_plain_head():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 40, bias=False)).to(torch.bfloat16)
    packed = nn.Sequential(plain[0], PrepackedLinear(plain[1]))
    cfg = dict(r=4, target_modules=["1"], init_lora_weights=False)
    torch.manual_seed(1)
    a = get_peft_model(plain, LoraConfig(**cfg))
    torch.manual_seed(1)
    b = get_peft_model(packed, LoraConfig(**cfg))
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(b(x), a(x), atol=2e-2, rtol=2e-2)
