"""The bf16 product (``llminfer.kernels.bf16_linear``, AVX-512 BF16) against float64, its batch invariance and
checks, its row limit in ``SkinnyLinear``, and a bf16 engine's layers and LM head on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import make_engine
from kernels_common import kernel_loaded, pytestmark  # noqa: F401  (the skip and the autouse fixture)
from llminfer.kernels import build
from llminfer.kernels.bf16_linear import BF16_KERNEL_MAX_ROWS, bf16_linear
from llminfer.kernels.layers import SkinnyLinear
from llminfer.models.kernel_swap import enable_cpu_kernels


def _ref(x, w, scale=None, bias=None):
    w64 = w.double() * (scale.double()[:, None] if scale is not None else 1.0)
    out = x.double() @ w64.T
    return out + bias.double() if bias is not None else out


def _bf16_path() -> bool:
    assert build.skinny_linear_available(), build.unavailable_reason()
    return build.bf16_kernel_available()


needs_bf16 = pytest.mark.skipif("avx512_bf16" not in build.cpu_flags() or build.target_isa() != "avx512",
                                reason="no AVX-512 BF16 path here (the CPU lacks it, or the AVX2 build is forced)")


@needs_bf16
@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 300])
@pytest.mark.parametrize("n, k", [(1, 32), (7, 512), (130, 64), (67, 1536), (6, 96)])
@pytest.mark.parametrize("bias", [None, "bf16", "fp32"])
def test_bf16_linear_matches_float64(m, n, k, bias):
    """Within float32 accumulation and one bf16 rounding of the float64 product of the same bf16 values."""
    assert _bf16_path()
    g = torch.Generator().manual_seed(m * 100 + n + k)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = None if bias is None else torch.randn(n, generator=g).to(torch.bfloat16 if bias == "bf16" else torch.float32)
    out = bf16_linear(x, w, b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    ref = _ref(x, w, None, b)
    # half a bf16 step of the result (2**-9 relative) plus float32 accumulation over k
    err = (out.double() - ref).abs()
    assert (err <= 2.0**-8 * ref.abs() + 1e-5 * k).all(), err.max()


@needs_bf16
def test_bf16_linear_rows_are_batch_invariant():
    """A row's bf16 result has the same bits alone and in any batch, at any place in a tile, on 1 or 2
    threads, with and without bias (the one-row stream and the interleaved tile run the same instructions)."""
    assert _bf16_path()
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(131, 512, generator=g).bfloat16(), torch.randn(131, generator=g).bfloat16()
    row = torch.randn(1, 512, generator=g).bfloat16()
    alone = [bf16_linear(row, w, bias) for bias in (None, b)]
    assert torch.equal(bf16_linear(row, w, b.float()), alone[1])  # a bf16 bias is widened exactly
    threads = torch.get_num_threads()
    try:
        for num_threads, m, at in ((1, 7, 5), (threads, 2, 0), (threads, 4, 3), (threads, 5, 4), (threads, 33, 17),
                                   (threads, 300, 150), (1, 300, 299)):
            torch.set_num_threads(num_threads)
            x = torch.randn(m, 512, generator=g).bfloat16()
            x[at] = row[0]
            for bias, ref in zip((None, b), alone):
                assert torch.equal(bf16_linear(x, w, bias)[at], ref[0]), (m, at, bias is None)
    finally:
        torch.set_num_threads(threads)


@needs_bf16
@pytest.mark.parametrize("args, match", [
    ((torch.randn(2, 48).bfloat16(), torch.randn(3, 48).bfloat16()), "multiple of 32"),
    ((torch.randn(2, 64), torch.randn(3, 64).bfloat16()), "bfloat16"),
    ((torch.randn(2, 64).bfloat16(), torch.randn(3, 64)), "bfloat16"),
    ((torch.randn(2, 64).bfloat16(), torch.randn(3, 32).bfloat16()), "K"),
    ((torch.randn(2, 64).bfloat16(), torch.randn(64, 3).bfloat16().t()), "contiguous"),
    ((torch.randn(2, 64).bfloat16(), torch.randn(3, 64).bfloat16(), torch.rand(4)), "bias"),
    ((torch.randn(2, 64).bfloat16(), torch.randn(3, 64).bfloat16(), torch.rand(3).half()), "bias"),
])
def test_bf16_linear_rejects_bad_arguments(args, match):
    assert _bf16_path()
    with pytest.raises(RuntimeError, match=match):
        bf16_linear(*args)


@needs_bf16
def test_bf16_skinny_linear_takes_the_kernel_up_to_its_row_limit():
    """A bf16 ``SkinnyLinear``: up to BF16_KERNEL_MAX_ROWS rows exactly :func:`bf16_linear`, beyond exactly
    ``F.linear``; ``enable_cpu_kernels`` swaps bf16 layers (K % 32 == 0) only where the path runs and
    ``LLMINFER_CPU_KERNEL_BF16`` is not 0."""
    assert _bf16_path()
    torch.manual_seed(0)
    lin = nn.Linear(64, 24).bfloat16()
    model = nn.Sequential(lin, nn.Linear(48, 8).bfloat16())  # 48 % 32 != 0: stays
    assert enable_cpu_kernels(model) == 1
    mod = model[0]
    assert isinstance(mod, SkinnyLinear) and type(model[1]) is nn.Linear and mod.weight is lin.weight
    limit = BF16_KERNEL_MAX_ROWS
    with torch.inference_mode():
        small = torch.randn(1, limit, 64).bfloat16()
        assert torch.equal(mod(small)[0], bf16_linear(small[0], lin.weight, lin.bias))
        big = torch.randn(limit + 1, 64).bfloat16()
        assert torch.equal(mod(big), F.linear(big, lin.weight, lin.bias))
    import os
    os.environ[build.BF16_ENV] = "0"
    try:
        assert not build.bf16_kernel_available()
        assert enable_cpu_kernels(nn.Sequential(nn.Linear(64, 8).bfloat16())) == 0
    finally:
        del os.environ[build.BF16_ENV]


@needs_bf16
def test_bf16_engine_runs_its_layers_and_small_head_steps_on_the_kernel(model_dirs, monkeypatch):
    """A bf16 engine (eager): every linear layer is a bf16 ``SkinnyLinear``, the oneDNN-packed head takes
    the kernel for small steps, ``info`` says so; with ``cpu_kernels=False`` or ``LLMINFER_CPU_KERNEL_BF16=0``
    none of that, and the greedy tokens of the first steps agree (bf16 rounding may part them later)."""
    from llminfer.kernels.prepack import PrepackedLinear

    assert _bf16_path()
    with make_engine(model_dirs["qwen2"], max_batch_size=2, dtype="bfloat16") as engine:
        model = engine.runtime.model
        swapped = [m for m in model.modules() if isinstance(m, SkinnyLinear)]
        assert swapped and all(m.weight.dtype == torch.bfloat16 for m in swapped)
        assert len(swapped) == engine.runtime.cpu_kernel_layers
        head = model.get_output_embeddings()
        assert isinstance(head, PrepackedLinear) and head.kernel_rows == BF16_KERNEL_MAX_ROWS
        line = engine.info()["cpu_kernel"]
        assert line.startswith("bf16_linear on ") and "bf16 on AVX-512 BF16 up to" in line, line
        assert engine.info()["attention_backend"] == "cpu"  # decode attention reads the bf16 cache in place
        on = engine.run("bf16 kernel", max_new_tokens=3, ignore_eos=True).token_ids
    for kw in ({"cpu_kernels": False}, {}):
        if not kw:
            monkeypatch.setenv(build.BF16_ENV, "0")
        with make_engine(model_dirs["qwen2"], max_batch_size=2, dtype="bfloat16", **kw) as engine:
            model = engine.runtime.model
            assert not any(isinstance(m, SkinnyLinear) for m in model.modules())
            assert getattr(model.get_output_embeddings(), "kernel_rows", 0) == 0
            assert engine.run("bf16 kernel", max_new_tokens=3, ignore_eos=True).token_ids[:1] == on[:1]


@needs_bf16
def test_bf16_empty_k_is_an_error():
    assert _bf16_path()
    with pytest.raises(RuntimeError, match="K must be a positive multiple"):
        bf16_linear(torch.randn(2, 0).bfloat16(), torch.randn(5, 0).bfloat16())


@needs_bf16
def test_bf16_engine_with_a_head_the_kernel_cannot_take(tmp_path):
    """hidden_size 48 (not a multiple of 32): the bf16 layers and LM head stay on torch (the packed head's
    small steps included), and requests run."""
    from llminfer.kernels.prepack import PrepackedLinear
    from llminfer.models import build_random_model

    assert _bf16_path()
    build_random_model(tmp_path / "m", hidden_size=48, intermediate_size=128, num_heads=4, num_kv_heads=2,
                       num_layers=2)
    with make_engine(tmp_path / "m", max_batch_size=2, dtype="bfloat16") as engine:
        head = engine.runtime.model.get_output_embeddings()
        assert isinstance(head, PrepackedLinear) and head.kernel_rows == 0
        assert len(engine.run("Hello there", max_new_tokens=5, ignore_eos=True).token_ids) == 5
