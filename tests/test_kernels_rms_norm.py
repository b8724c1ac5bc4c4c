"""llminfer's RMSNorm op (csrc/rms_norm.cpp) and its module (kernels.layers.KernelRMSNorm): transformers' norm
to float32 rounding, a row's bits independent of the other rows, and the kernel swap that puts it in a model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llminfer.kernels import build
from llminfer.kernels.layers import KernelRMSNorm

needs_kernel = pytest.mark.skipif(not build.skinny_linear_available(), reason="llminfer's CPU kernel does not build here")


def _hf_norm(width: int, eps: float, seed: int):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(width, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(seed)))
    return norm


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(width=st.integers(1, 300), rows=st.integers(1, 70), seed=st.integers(0, 2**16),
       eps=st.sampled_from([1e-6, 1e-5]), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_op_is_the_hf_norm_to_rounding_and_batch_invariant(width, rows, seed, eps, scale) -> None:
    norm = _hf_norm(width, eps, seed)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed + 1)) * scale
    with torch.inference_mode():
        ref = norm(x)
        out = KernelRMSNorm(norm)(x)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6 * float(norm.weight.abs().max()))
    for r in range(rows):
        with torch.inference_mode():
            assert torch.equal(torch.ops.llminfer_cpu.rms_norm(x[r:r + 1].clone(), norm.weight, eps), out[r:r + 1])


@needs_kernel
def test_module_falls_back_off_its_op_and_shares_the_weight() -> None:
    norm = _hf_norm(64, 1e-6, 0)
    swapped = KernelRMSNorm(norm)
    assert swapped.weight is norm.weight and "weight" in swapped.state_dict()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(swapped(x), norm(x))  # bf16: transformers' operations
    x32 = torch.randn(2, 7, 64, requires_grad=True)
    swapped(x32).sum().backward()  # autograd: transformers' operations, differentiable
    assert x32.grad is not None


@needs_kernel
def test_op_rejects_bad_arguments() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.llminfer_cpu.rms_norm(torch.randn(2, 8).double(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="disagree"):
        torch.ops.llminfer_cpu.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-6)


@needs_kernel
def test_the_kernel_swap_puts_every_fp32_norm_on_the_op() -> None:
    import transformers

    from llminfer.models.kernel_swap import enable_cpu_kernels

    config = transformers.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.Qwen2ForCausalLM(config).eval()
    ids = torch.randint(0, 97, (1, 9))
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    assert enable_cpu_kernels(model) > 0
    norms = [m for m in model.modules() if "RMSNorm" in type(m).__name__]
    assert norms and all(type(m) is KernelRMSNorm for m in norms)
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-4, atol=1e-4)
