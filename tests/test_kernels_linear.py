"""The fp32 / int8 linear products (``llminfer.kernels.linear``: skinny_linear, int8_linear) against float64 and
exact-integer references, their batch invariance and argument checks, and the layers that run on them
(``SkinnyLinear``, the int8-wo layer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels_common import kernel_loaded, pytestmark  # noqa: F401  (the skip and the autouse fixture)
from llminfer.kernels import build
from llminfer.kernels.layers import SkinnyLinear
from llminfer.kernels.linear import int8_linear, skinny_linear
from llminfer.kernels.q8_linear import int8_linear_q8
from llminfer.models.kernel_swap import enable_cpu_kernels
from llminfer.models.weight_only import Int8WeightOnlyLinear


def _ref(x, w, scale=None, bias=None):
    w64 = w.double() * (scale.double()[:, None] if scale is not None else 1.0)
    out = x.double() @ w64.T
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 33])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 130])
@pytest.mark.parametrize("k", [8, 520])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_fp32_matches_float64(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    out = skinny_linear(x, w, None, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _ref(x, w, None, b), atol=1e-4 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 4, 6, 32])
def test_skinny_linear_int8_matches_dequantized(m):
    g = torch.Generator().manual_seed(m)
    n, k = 67, 136
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale, bias = torch.rand(n, generator=g) / 50, torch.randn(n, generator=g)
    out = skinny_linear(x, q, scale, bias)
    torch.testing.assert_close(out.double(), _ref(x, q, scale, bias), atol=1e-4, rtol=1e-5)


def _integer_path() -> bool:
    """Whether int8 products run on the VNNI build's integer path here."""
    assert build.skinny_linear_available(), build.unavailable_reason()
    return build.int8_activation_bits() == 14


def _int8_integer_ref(x, q, scale, bias):
    """The integer path's result computed by torch: each row rounded to 14 bits (``sx = max|x| / 8191``,
    ``round(x / sx)``), the exact int64 dot product, ``float32(double(dot) * sx * scale) + bias``."""
    sx = x.abs().amax(1) / 8191
    safe = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = torch.where(sx[:, None] > 0, torch.round(x / safe[:, None]), torch.zeros_like(x)).clamp(-8191, 8191)
    dot = xq.long() @ q.long().T
    out = (dot.double() * sx.double()[:, None] * scale.double()[None, :]).float()
    return out + bias if bias is not None else out


@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 300])
@pytest.mark.parametrize("n, k", [(1, 32), (7, 512), (130, 64), (67, 1536), (5, 520), (6, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_exact_integer_arithmetic(m, n, k, bias):
    """On the VNNI build with K % 32 == 0: bit for bit the torch reference of the integer scheme, and within
    the activation rounding's bound of float64; anywhere else exactly :func:`skinny_linear`."""
    g = torch.Generator().manual_seed(m * 100 + n + k)
    x = torch.randn(m, k, generator=g) * 3
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale, b = torch.rand(n, generator=g) / 50, (torch.randn(n, generator=g) if bias else None)
    out = int8_linear(x, q, scale, b)
    if not (_integer_path() and k % 32 == 0):
        assert torch.equal(out, skinny_linear(x, q, scale, b))
        return
    assert torch.equal(out, _int8_integer_ref(x, q, scale, b))
    # |error| <= half a rounding step of each activation times the weights' absolute sum
    step = x.abs().amax(1, keepdim=True).double() / 8191
    bound = 0.5 * step * (q.double().abs() * scale.double()[:, None]).sum(1)[None, :]
    err = (out.double() - _ref(x, q, scale, b)).abs()
    assert (err <= bound + 1e-4 * out.double().abs() + 1e-5).all()


def test_int8_linear_rows_with_nan_or_zeros():
    """A row holding a NaN or an infinity gives NaN outputs (as float32 activations would); an all-zero row
    gives the bias; neither changes the other rows."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    x[1, 5], x[2] = float("nan"), 0.0
    x[3, 0] = float("inf")
    q, s, b = torch.randint(-127, 128, (9, 64), generator=g, dtype=torch.int8), torch.rand(9, generator=g), torch.randn(9)
    out = int8_linear(x, q, s, b)
    assert torch.isnan(out[1]).all() and torch.equal(out[2], b) and not torch.isfinite(out[3]).any()
    assert torch.equal(out[0], int8_linear(x[:1], q, s, b)[0])


def test_skinny_linear_rows_are_batch_invariant():
    """A row's result has the same bits alone, in any batch (decode-sized or prefill-sized, which run the
    tiles in different orders), at any place in a tile, with 1 or 2 threads, fp32 or int8 (both
    :func:`skinny_linear` and :func:`int8_linear`, whose VNNI path quantizes each row), with the scale and
    bias epilogue: the kernel's operations depend on nothing but K."""
    g = torch.Generator().manual_seed(0)
    w, w8, s = torch.randn(131, 512, generator=g), torch.randint(-127, 128, (131, 512), generator=g,
                                                                  dtype=torch.int8), torch.rand(131, generator=g)
    b = torch.randn(131, generator=g)
    row = torch.randn(1, 512, generator=g)
    sk, i8 = skinny_linear, int8_linear
    variants = [(sk, w, None, None), (sk, w, None, b), (sk, w8, s, None), (sk, w8, s, b), (i8, w8, s, None),
                (i8, w8, s, b)]
    alone = [fn(row, *v) for fn, *v in variants]
    threads = torch.get_num_threads()
    try:
        # streamed tiles of 1-8 rows, fp32 blocked past 8, int8 streamed up to 16 (converted in registers),
        # more (blocked, int8 converted once per block)
        for num_threads, m, at in ((1, 7, 5), (threads, 7, 3), (threads, 32, 31), (threads, 2, 0), (threads, 4, 2),
                                   (threads, 5, 4), (threads, 8, 7), (threads, 9, 8), (threads, 12, 10),
                                   (threads, 16, 13), (threads, 17, 16), (threads, 300, 150), (1, 300, 299)):
            torch.set_num_threads(num_threads)
            x = torch.randn(m, 512, generator=g)
            x[at] = row[0]
            for (fn, *v), ref in zip(variants, alone):
                assert torch.equal(fn(x, *v)[at], ref[0]), (m, at, fn, v[0].dtype, v[2] is None)
    finally:
        torch.set_num_threads(threads)


def test_skinny_linear_streamed_rows_of_a_large_weight_are_batch_invariant():
    """An fp32 weight of 32 MiB or more (an LM head) streams tiles of up to 8 rows from memory; a row still has
    the bits it has alone and in the L2-blocked path beyond 8 rows, and agrees with float64."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16384 + 5, 512, generator=g)  # just over 32 MiB; 5 channels past a whole tile
    b = torch.randn(w.shape[0], generator=g)
    row = torch.randn(1, 512, generator=g)
    alone = skinny_linear(row, w, None, b)
    torch.testing.assert_close(alone.double(), _ref(row, w, None, b), atol=1e-4 * 512**0.5, rtol=1e-5)
    for m, at in ((2, 1), (5, 3), (8, 7), (9, 8), (12, 10)):
        x = torch.randn(m, 512, generator=g)
        x[at] = row[0]
        assert torch.equal(skinny_linear(x, w, None, b)[at], alone[0]), (m, at)


@pytest.mark.parametrize("args, match", [
    ((torch.randn(2, 12), torch.randn(3, 12)), "multiple of 8"),
    ((torch.randn(2, 16).double(), torch.randn(3, 16)), "float32"),
    ((torch.randn(2, 16), torch.randn(3, 8)), "K"),
    ((torch.randn(2, 16), torch.randn(3, 16).half()), "float32 or int8"),
    ((torch.randn(2, 16), torch.randn(16, 3).t()), "contiguous"),
    ((torch.randn(2, 16), torch.randn(3, 16), torch.rand(4)), "scale"),
])
def test_skinny_linear_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        skinny_linear(*args)


@pytest.mark.parametrize("args, match", [
    ((torch.randn(2, 64), torch.randn(3, 64), torch.rand(3)), "int8"),
    ((torch.randn(2, 64), torch.ones(3, 64, dtype=torch.int8), torch.rand(4)), "scale"),
    ((torch.randn(2, 64).double(), torch.ones(3, 64, dtype=torch.int8), torch.rand(3)), "float32"),
    ((torch.randn(2, 64), torch.ones(3, 32, dtype=torch.int8), torch.rand(3)), "K"),
    ((torch.randn(2, 64), torch.ones(3, 64, dtype=torch.int8), torch.rand(3), torch.rand(2)), "bias"),
])
def test_int8_linear_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        int8_linear(*args)


def test_skinny_linear_module_falls_back_outside_its_domain():
    torch.manual_seed(0)
    lin = nn.Linear(64, 24)
    mod = SkinnyLinear(lin)
    assert mod.weight is lin.weight and mod.bias is lin.bias
    with torch.inference_mode():
        for x in (torch.randn(3, 5, 64), torch.randn(1000, 64)):  # decode- and prefill-sized: the kernel
            out = mod(x)
            assert torch.equal(out, skinny_linear(x.reshape(-1, 64), lin.weight, None, lin.bias)
                               .reshape(out.shape))
            torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        x = torch.randn(2, 64).double()  # another dtype: F.linear, which refuses the mix like nn.Linear
        with pytest.raises(RuntimeError):
            mod(x)
    x = torch.randn(2, 64, requires_grad=True)
    mod(x).sum().backward()  # gradients take F.linear
    assert x.grad is not None


def test_int8_weight_only_layer_uses_the_kernel_at_any_row_count():
    torch.manual_seed(0)
    lin = nn.Linear(64, 40)
    layer = Int8WeightOnlyLinear(lin)
    assert enable_cpu_kernels(nn.Sequential(layer)) == 1 and layer.use_cpu_kernel
    want = lambda x: F.linear(x.double(), layer.dequantized_weight().double(), lin.bias.double())  # noqa: E731
    with torch.inference_mode():
        small = torch.randn(2, 3, 64)  # 6 rows: the kernel (float32 or, on VNNI, 14-bit activations)
        flat = small.reshape(6, 64)
        q8 = layer.kernel_path == "q8"  # the path quant_paths chose: 8-bit block activations (test_kernels_q8)
        product = int8_linear_q8 if q8 else int8_linear
        assert torch.equal(layer(small).reshape(6, 40), product(flat, layer.weight, layer.scales.float(), lin.bias.detach()))
        atol, rtol = (5e-2, 2e-2) if q8 else (1e-4 if not _integer_path() else 1e-3, 1e-5)
        torch.testing.assert_close(layer(small).double(), want(small), atol=atol, rtol=rtol)
        big = torch.randn(300, 64)
        torch.testing.assert_close(layer(big).double(), want(big), atol=atol, rtol=rtol)
        layer.use_cpu_kernel = False  # torch's kernel: bf16 activations, so only close
        torch.testing.assert_close(layer(big).double(), want(big), atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("call", [
    lambda: skinny_linear(torch.randn(2, 0), torch.randn(3, 0)),
    lambda: int8_linear(torch.randn(2, 0), torch.zeros(3, 0, dtype=torch.int8), torch.rand(3)),
])
def test_empty_k_is_an_error_not_a_crash(call):
    """K = 0 once divided the work grain by zero (SIGFPE, the process gone): now a RuntimeError."""
    with pytest.raises(RuntimeError, match="K must be a positive multiple"):
        call()
