"""int8-wo's group-wise format (llminfer.kernels.int8_group_linear) and its CPU kernel (csrc/int8_group_linear.cpp).

The kernel is checked against the dequantized weight in float64 within the bound its 14-bit activation
rounding allows, for batch invariance (a row's bits do not depend on the other rows), for NaN rows and for
its argument checks. The quantizer is checked to recover GGUF's Q8_0 and Q4_1 grids exactly, and with
hypothesis never to be worse than either grid alone.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from llminfer.kernels import int8_group_linear as int8_group
from llminfer.kernels.int8_group_linear import dequantize_int8_groupwise, quantize_int8_groupwise
from llminfer.models.weight_only import Int8GroupWeightOnlyLinear, Int8WeightOnlyLinear, quantize_model

needs_kernel = pytest.mark.skipif(not int8_group.kernel_available(), reason="llminfer's CPU kernel does not build here")


def _q8_0_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight dequantized from GGUF Q8_0 blocks: d * q, q in [-127, 127], each block's largest |q| 127."""
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g).half().float() * 0.01 + 1e-4
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127.0
    return (q * d[..., None]).reshape(n, k)


def _with_weight(linear: nn.Linear, weight: torch.Tensor) -> nn.Linear:
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def _q4_1_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight dequantized from GGUF Q4_1 blocks: m + d * q, q in [0, 15], both ends used."""
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g).half().float() * 0.01 + 1e-4
    m = -torch.rand(n, k // 32, generator=g).half().float() * 0.1
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0.0, 15.0
    return (m[..., None] + q * d[..., None]).reshape(n, k)


@pytest.mark.parametrize("make", [_q8_0_weight, _q4_1_weight])
def test_gguf_grids_come_back_exactly(make) -> None:
    w = make(24, 128, 0)
    codes, scale, minimum = quantize_int8_groupwise(w, 32)
    assert codes.dtype == torch.uint8 and scale.shape == minimum.shape == (24, 4)
    torch.testing.assert_close(dequantize_int8_groupwise(codes, scale, minimum), w, rtol=0, atol=2e-7)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(0, 2**31 - 1), st.sampled_from([32, 64]), st.floats(0.0, 3.0))
def test_each_group_takes_the_closer_grid(seed: int, group_size: int, shift: float) -> None:
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(seed)) + shift
    codes, scale, minimum = quantize_int8_groupwise(w, group_size)
    err = (dequantize_int8_groupwise(codes, scale, minimum) - w).reshape(4, -1, group_size).square().sum(-1)
    g = w.reshape(4, -1, group_size)
    # both grids on bfloat16 values: the minimum rounded down, the scale up
    lo, hi = int8_group.bfloat16_floor(g.amin(-1, keepdim=True)), g.amax(-1, keepdim=True)
    a_scale = int8_group.bfloat16_ceil((hi - lo) / 255)
    asym = torch.round((g - lo) / a_scale).clamp(0, 255) * a_scale + lo
    s_scale = int8_group.bfloat16_ceil(torch.maximum(hi.abs(), lo.abs()) / 127)
    sym = torch.round(g / s_scale).clamp(-127, 127) * s_scale
    best = torch.minimum((asym - g).square().sum(-1), (sym - g).square().sum(-1))
    assert bool((err <= best * (1 + 1e-4) + 1e-10).all())
    assert int(codes.min()) >= 0 and int(codes.max()) <= 255
    # the grid covers every group: no code is clamped by more than float32 rounding
    assert bool(((dequantize_int8_groupwise(codes, scale, minimum) - w).abs()
                 <= scale.repeat_interleave(group_size, 1) * (0.5 + 1e-4)).all())
    assert int8_group.is_exact_in(scale, torch.bfloat16) and int8_group.is_exact_in(minimum, torch.bfloat16)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.floats(-(2.0**126), 2.0**126, allow_subnormal=True, width=32), min_size=1, max_size=40))
def test_bfloat16_rounding_brackets_each_value(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    down, up = int8_group.bfloat16_floor(x), int8_group.bfloat16_ceil(x)
    assert int8_group.is_exact_in(down, torch.bfloat16) and int8_group.is_exact_in(up, torch.bfloat16)
    assert bool((down <= x).all() and (x <= up).all())
    # neighbours: no bfloat16 value lies strictly between, so equal where x is one, else one step apart
    exact = x.to(torch.bfloat16).float() == x
    assert bool((down[exact] == x[exact]).all() and (up[exact] == x[exact]).all())
    step = (up.view(torch.int32) - down.view(torch.int32)).abs()
    assert bool((step[~exact & (down.sign() == up.sign())] == 1 << 16).all())


def test_quantizer_refuses_bad_group_sizes() -> None:
    with pytest.raises(ValueError, match="group size"):
        quantize_int8_groupwise(torch.randn(4, 96), 48)
    with pytest.raises(ValueError, match="in_features % 64"):
        quantize_int8_groupwise(torch.randn(4, 96), 64)


@needs_kernel
@pytest.mark.parametrize(("n", "k", "group_size"), [(37, 64, 32), (100, 576, 32), (19, 1536, 64), (8, 256, 256)])
def test_kernel_matches_the_dequantized_product_and_is_batch_invariant(n: int, k: int, group_size: int) -> None:
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen) * 0.05
    codes, scale, minimum = quantize_int8_groupwise(w, group_size)
    wd = dequantize_int8_groupwise(codes, scale, minimum).double()
    x = torch.randn(9, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    out = int8_group.int8_group_linear(x, codes, scale, minimum, group_size, bias)
    ref = x.double() @ wd.T + bias.double()
    # 14-bit activations: each element off by at most max|x| / 8191 / 2, times sum |w| of its channel.
    bound = (x.abs().amax(1, keepdim=True).double() / 8191 / 2) * wd.abs().sum(1)[None, :] + 1e-4
    assert bool(((out.double() - ref).abs() <= bound).all())
    for rows in (slice(0, 1), slice(3, 5), slice(2, 9)):
        part = int8_group.int8_group_linear(x[rows].contiguous(), codes, scale, minimum, group_size, bias)
        assert torch.equal(part, out[rows])


@needs_kernel
def test_kernel_nan_row_stays_in_its_row_and_zero_row_gives_bias() -> None:
    codes, scale, minimum = quantize_int8_groupwise(torch.randn(16, 64), 32)
    x = torch.randn(3, 64)
    x[1, 7] = float("nan")
    x[2] = 0.0
    bias = torch.randn(16)
    out = int8_group.int8_group_linear(x, codes, scale, minimum, 32, bias)
    assert out[1].isnan().all() and not out[0].isnan().any()
    torch.testing.assert_close(out[2], bias)


@needs_kernel
def test_kernel_argument_errors_are_clear() -> None:
    codes, scale, minimum = quantize_int8_groupwise(torch.randn(16, 64), 32)
    with pytest.raises(RuntimeError, match="group_size must be"):
        int8_group.int8_group_linear(torch.randn(1, 64), codes, scale, minimum, 48)
    with pytest.raises(RuntimeError, match="float32"):
        int8_group.int8_group_linear(torch.randn(1, 64).double(), codes, scale, minimum, 32)
    with pytest.raises(RuntimeError, match="scale and minimum"):
        int8_group.int8_group_linear(torch.randn(1, 64), codes, scale[:, :1].contiguous(), minimum, 32)


def test_layer_and_quantize_model_choose_the_format() -> None:
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16), nn.Linear(40, 8))
    report = quantize_model(model, "int8-wo", int8_group_size=32)
    if int8_group.kernel_available():
        assert report["int8_format"] == "groups of 32"
        assert isinstance(model[0], Int8GroupWeightOnlyLinear) and isinstance(model[1], Int8GroupWeightOnlyLinear)
        assert isinstance(model[2], Int8WeightOnlyLinear)  # 40 columns: not a whole number of groups
    per_channel = nn.Sequential(nn.Linear(64, 32))
    assert quantize_model(per_channel, "int8-wo", int8_group_size=0)["int8_format"] == "per channel"
    assert isinstance(per_channel[0], Int8WeightOnlyLinear)


def test_layer_fallback_without_the_kernel_equals_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    lin = nn.Linear(64, 24)
    layer = Int8GroupWeightOnlyLinear(lin, 32)
    x = torch.randn(2, 3, 64)
    ref = x.double() @ layer.dequantized_weight().double().T + lin.bias.double()
    monkeypatch.setattr(Int8GroupWeightOnlyLinear, "_op", False)
    fallback = layer(x)
    assert fallback.shape == (2, 3, 24)
    torch.testing.assert_close(fallback.double(), ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(Int8GroupWeightOnlyLinear, "_op", None)
    if int8_group.kernel_available():
        torch.testing.assert_close(layer(x).double(), ref, rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------ the q8 path (csrc/int8_group_linear_q8.cpp)
def _blocked(*params: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return tuple(int8_group.pack_group_q8_params(p, dtype) for p in params)


def _q8_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per output element: sum_k |W[n, k]| * d[m, block(k)] / 2 (the 8-bit activation rounding) plus float32
    sums, with d = max|x| / 127 per block of 32 columns (llama.cpp's Q8_0)."""
    m, k = x.shape
    d = x.double().reshape(m, k // 32, 32).abs().amax(-1) / 127
    per_block = weight.double().abs().reshape(weight.shape[0], k // 32, 32).sum(-1)
    return (d / 2) @ per_block.T + 1e-4 * (1 + x.double().abs() @ weight.double().abs().T)


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), groups=st.integers(1, 40), rows=st.integers(1, 9), seed=st.integers(0, 2**16),
       bias=st.booleans())
def test_q8_kernel_is_within_its_rounding_bound_and_batch_invariant(n, groups, rows, seed, bias) -> None:
    # groups up to 40: full and partial runs of 16 (AVX-512) and 8 (AVX2) groups in the packed order
    k = 32 * groups
    gen = torch.Generator().manual_seed(seed)
    codes, scale, minimum = quantize_int8_groupwise(torch.randn(n, k, generator=gen), 32)
    weight = dequantize_int8_groupwise(codes, scale, minimum)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    b = torch.randn(n, generator=gen) if bias else None
    packed = int8_group.pack_int8_group_q8(codes)
    assert torch.equal(int8_group.unpack_int8_group_q8(packed, n), codes)
    assert int8_group.q8_params_dtype(scale, minimum) == torch.bfloat16  # the quantizer's bfloat16 grid
    halves = _blocked(scale, minimum, dtype=torch.bfloat16)
    row_major, (scale, minimum) = scale, _blocked(scale, minimum)
    assert torch.equal(int8_group.unpack_group_q8_params(scale, n), row_major)
    assert torch.equal(int8_group.unpack_group_q8_params(halves[0], n), row_major)
    out = int8_group.int8_group_linear_q8(x, packed, scale, minimum, n, b)
    assert torch.equal(int8_group.int8_group_linear_q8(x, packed, *halves, n, b), out)  # 2 bytes, same values
    ref = x.double() @ weight.double().T + (0 if b is None else b.double())
    assert ((out.double() - ref).abs() <= _q8_bound(x, weight)).all()
    for r in range(rows):  # a row's bits do not depend on the other rows
        assert torch.equal(int8_group.int8_group_linear_q8(x[r:r + 1].clone(), packed, scale, minimum, n, b),
                           out[r:r + 1])


@needs_kernel
def test_q8_kernel_uses_the_exact_integer_sums() -> None:
    # activations already on their 8-bit grid (d = 1: each block holding 127, the rest in [-3, 3]) and codes
    # with scale 1, minimum 0: the product is an exact integer, which float32 holds. (Plain AVX2 rounds
    # 254 * a group's sum to float32, exact below 2^24: |sum| <= 255 * (127 + 31 * 3) keeps it there.)
    gen = torch.Generator().manual_seed(3)
    k, n = 32 * 20, 24
    x = torch.randint(-3, 4, (3, k), generator=gen).float()
    x.view(3, -1, 32)[..., 0] = 127.0
    codes = torch.randint(0, 256, (n, k), generator=gen).to(torch.uint8)
    codes[0], codes[1] = 0, 255  # the codes' ends
    scale, minimum = torch.ones(n, k // 32), torch.zeros(n, k // 32)
    out = int8_group.int8_group_linear_q8(x, int8_group.pack_int8_group_q8(codes), *_blocked(scale, minimum), n)
    assert torch.equal(out.double(), x.double() @ codes.double().T)


@needs_kernel
def test_q8_kernel_nan_row_and_argument_errors() -> None:
    codes, scale, minimum = quantize_int8_groupwise(torch.randn(8, 64), 32)
    packed = int8_group.pack_int8_group_q8(codes)
    scale, minimum = _blocked(scale, minimum)
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    out = int8_group.int8_group_linear_q8(x, packed, scale, minimum, 8)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        int8_group.int8_group_linear_q8(torch.randn(1, 48), torch.zeros(8, 48, dtype=torch.uint8),
                                        torch.ones(8, 1), torch.zeros(8, 1), 8)
    with pytest.raises(RuntimeError, match="codes must be"):
        int8_group.int8_group_linear_q8(x[:1], packed, scale, minimum, 40)
    with pytest.raises(RuntimeError, match="scale and minimum"):
        int8_group.int8_group_linear_q8(x[:1], packed, scale[:, :1].contiguous(), minimum, 8)
    with pytest.raises(RuntimeError, match="one dtype, float32, bfloat16 or float16"):
        int8_group.int8_group_linear_q8(x[:1], packed, scale, minimum.to(torch.bfloat16), 8)
    with pytest.raises(RuntimeError, match="one dtype, float32, bfloat16 or float16"):
        int8_group.int8_group_linear_q8(x[:1], packed, scale.double(), minimum.double(), 8)


@needs_kernel
def test_layer_on_the_q8_path_keeps_its_weight_and_agrees_with_the_wide_path() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    layer = Int8GroupWeightOnlyLinear(linear, 32)
    x = torch.randn(2, 5, 96)
    wide = layer(x)
    before = layer.dequantized_weight()
    assert layer.use_q8_path() and layer.kernel_path == "q8" and layer.use_q8_path()  # idempotent
    assert torch.equal(layer.dequantized_weight(), before)  # the re-laid-out codes are the same weight
    q8 = layer(x)
    assert q8.shape == wide.shape and q8.dtype == torch.float32
    assert ((q8 - wide).double().abs() <= _q8_bound(x.reshape(-1, 96), before).reshape(2, 5, 40) + 1e-3).all()
    assert layer.scale.dtype == layer.minimum.dtype == torch.bfloat16  # 2 bytes a group each
    gguf = Int8GroupWeightOnlyLinear(_with_weight(nn.Linear(128, 24), _q4_1_weight(24, 128, 3)), 32)
    assert gguf.use_q8_path() and gguf.scale.dtype == torch.float32  # a GGUF grid is kept exactly
    torch.testing.assert_close(gguf.dequantized_weight(), _q4_1_weight(24, 128, 3), rtol=0, atol=2e-7)
    wider = Int8GroupWeightOnlyLinear(nn.Linear(128, 8), 64)
    assert not wider.use_q8_path() and wider.kernel_path == "wide"  # the q8 kernel takes groups of 32 only


@needs_kernel
@pytest.mark.parametrize("path", ["q8", "wide"])
def test_kernel_swap_puts_every_group_of_32_layer_on_the_chosen_path(monkeypatch, path) -> None:
    from llminfer.models import kernel_swap

    small, large = Int8GroupWeightOnlyLinear(nn.Linear(64, 8), 32), Int8GroupWeightOnlyLinear(nn.Linear(64, 400), 32)
    wider = Int8GroupWeightOnlyLinear(nn.Linear(128, 8), 64)
    model = nn.ModuleList([small, large, wider])
    paths = {"int8": {"path": "wide", "how": "measured"}, "int8-group": {"path": path, "how": "measured"},
             "int4": {"path": "wide", "how": "measured"}}
    monkeypatch.setattr(kernel_swap, "quant_paths", lambda: paths)
    before = [m(torch.randn(3, m.in_features, generator=torch.Generator().manual_seed(1))) for m in model]
    kernel_swap.enable_cpu_kernels(model)
    assert small.kernel_path == large.kernel_path == path and wider.kernel_path == "wide"
    after = [m(torch.randn(3, m.in_features, generator=torch.Generator().manual_seed(1))) for m in model]
    assert all(torch.allclose(a, b, atol=1e-2) for a, b in zip(after, before))


# ------------------------------------------- int4-wo's groups of 32 on the same path (int4_group_linear_q8)
def _int4_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randint(0, 16, (n, k), generator=gen)
    # bfloat16 values (as the quantizers give), so the parameters pack in either dtype
    scale = (torch.rand(n, k // 32, generator=gen) * 0.1 + 1e-3).bfloat16().float()
    zero = -torch.rand(n, k // 32, generator=gen).bfloat16().float()
    weight = q.double() * scale.double().repeat_interleave(32, 1) + zero.double().repeat_interleave(32, 1)
    return q, scale, zero, weight


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), groups=st.integers(1, 40), rows=st.integers(1, 9), seed=st.integers(0, 2**16),
       bias=st.booleans())
def test_int4_group_kernel_is_within_its_rounding_bound_and_batch_invariant(n, groups, rows, seed, bias) -> None:
    k = 32 * groups  # full and partial super-blocks of 16 (AVX-512) and 8 (AVX2) groups
    gen = torch.Generator().manual_seed(seed)
    q, scale, zero, weight = _int4_weight(n, k, gen)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    b = torch.randn(n, generator=gen) if bias else None
    packed = int8_group.pack_int4_group_q8(q)
    lanes = int8_group.group_q8_lanes()
    assert packed.shape == (-(-n // lanes), lanes * k // 2)
    assert torch.equal(int8_group.unpack_int4_group_q8(packed, n), q.int())
    halves = _blocked(scale, zero, dtype=torch.bfloat16)
    fp16 = _blocked(scale.half().float(), zero.half().float(), dtype=torch.float16)  # the GGUF grids' scales
    scale, zero = _blocked(scale, zero)
    out = int8_group.int4_group_linear_q8(x, packed, scale, zero, n, b)
    assert torch.equal(int8_group.int4_group_linear_q8(x, packed, *halves, n, b), out)
    # float16 parameters: the same as their values in float32
    as_f32 = tuple(t.float() for t in fp16)
    assert torch.equal(int8_group.int4_group_linear_q8(x, packed, *fp16, n, b),
                       int8_group.int4_group_linear_q8(x, packed, *as_f32, n, b))
    ref = x.double() @ weight.T + (0 if b is None else b.double())
    assert ((out.double() - ref).abs() <= _q8_bound(x, weight.float())).all()
    for r in range(rows):
        assert torch.equal(int8_group.int4_group_linear_q8(x[r:r + 1].clone(), packed, scale, zero, n, b),
                           out[r:r + 1])


@needs_kernel
def test_int4_group_kernel_uses_the_exact_integer_sums_and_checks_its_arguments() -> None:
    gen = torch.Generator().manual_seed(5)
    k, n = 32 * 20, 24
    x = torch.randint(-127, 128, (3, k), generator=gen).float()
    x.view(3, -1, 32)[..., 0] = 127.0  # d = 1: the activations are their own first digit
    q = torch.randint(0, 16, (n, k), generator=gen)
    q[0], q[1] = 0, 15
    packed = int8_group.pack_int4_group_q8(q)
    scale, zero = _blocked(torch.ones(n, k // 32), torch.zeros(n, k // 32))
    out = int8_group.int4_group_linear_q8(x, packed, scale, zero, n)
    assert torch.equal(out.double(), x.double() @ q.double().T)
    x[1, 7] = float("nan")
    out = int8_group.int4_group_linear_q8(x, packed, scale, zero, n)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    with pytest.raises(RuntimeError, match="codes must be a contiguous uint8"):
        int8_group.int4_group_linear_q8(x, q.to(torch.uint8), scale, zero, n)


@needs_kernel
def test_int4_layer_on_the_q8_path_with_groups_of_32_runs_the_group_kernel() -> None:
    from llminfer.models.weight_only import Int4WeightOnlyLinear

    gen = torch.Generator().manual_seed(9)
    lin = nn.Linear(96, 40)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=gen) / 8)
    layer = Int4WeightOnlyLinear(lin, group_size=32)
    codes = layer.codes()
    layer.use_llminfer_kernel("q8")
    lanes = int8_group.group_q8_lanes()
    assert layer.weight.shape == (-(-40 // lanes), lanes * 48) and torch.equal(layer.codes(), codes)
    x = torch.randn(5, 96, generator=gen)
    want = int8_group.int4_group_linear_q8(x, layer.weight, layer.kernel_scales, layer.kernel_zeros, 40,
                                           lin.bias.detach().float())
    assert torch.equal(layer(x), want)
    dense = layer.dequantized_weight()
    ref = x.double() @ dense.double().T + lin.bias.detach().double()
    assert ((layer(x).double() - ref).abs() <= _q8_bound(x, dense)).all()


def test_int4_quantizer_keeps_gguf_grids_and_otherwise_gives_bfloat16_parameters() -> None:
    from llminfer.models.quantizers import dequantize_int4, quantize_int4_groupwise

    w = _q4_1_weight(24, 128, 4)
    q, sz = quantize_int4_groupwise(w, 32)
    torch.testing.assert_close(dequantize_int4(q, sz, 32), w, rtol=0, atol=2e-7)
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(4))
    q, sz = quantize_int4_groupwise(w, 32)
    scale, minimum = sz[..., 0], sz[..., 1] - 8 * sz[..., 0]
    assert int8_group.is_exact_in(scale, torch.bfloat16) and int8_group.is_exact_in(minimum, torch.bfloat16)
    # the rounded grid still covers each group: every weight within half a step of its code's value
    err = (dequantize_int4(q, sz, 32) - w).abs()
    assert bool((err <= scale.t().repeat_interleave(32, 1) * (0.5 + 1e-4)).all())


@needs_kernel
def test_an_int4_layer_from_a_gguf_grid_keeps_it_exactly_in_float16_parameters() -> None:
    from llminfer.models.weight_only import Int4WeightOnlyLinear

    gen = torch.Generator().manual_seed(6)  # GGUF Q4_1 blocks: m + d * q with fp16 d and m
    d = (torch.rand(40, 3, 1, generator=gen) * 0.01 + 1e-4).half().float()
    m = (-torch.rand(40, 3, 1, generator=gen) * 0.1).half().float()
    q = torch.randint(0, 16, (40, 3, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0.0, 15.0
    w = (m + q * d).reshape(40, 96)
    layer = Int4WeightOnlyLinear(_with_weight(nn.Linear(96, 40), w), group_size=32, compute_dtype=torch.float32)
    layer.use_llminfer_kernel("q8")
    assert layer.kernel_scales.dtype == layer.kernel_zeros.dtype == torch.float16  # 2 bytes, exact
    torch.testing.assert_close(layer.dequantized_weight(), w, rtol=0, atol=2e-7)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(6))
    ref = x.double() @ w.double().T + layer.bias.detach().double()
    assert ((layer(x).double() - ref).abs() <= _q8_bound(x, w)).all()


@needs_kernel
def test_an_int8_layer_from_q8_0_blocks_keeps_them_in_float16_and_empty_weights_quantize() -> None:
    gen = torch.Generator().manual_seed(8)  # GGUF Q8_0 blocks: d * q with an fp16 d, each block's max |q| 127
    d = (torch.rand(24, 4, 1, generator=gen) * 0.01 + 1e-4).half().float()
    q = torch.randint(-127, 128, (24, 4, 32), generator=gen).float()
    q[..., 0] = 127.0
    w = (q * d).reshape(24, 128)
    layer = Int8GroupWeightOnlyLinear(_with_weight(nn.Linear(128, 24), w), 32)
    assert layer.use_q8_path() and layer.scale.dtype == layer.minimum.dtype == torch.float16
    torch.testing.assert_close(layer.dequantized_weight(), w, rtol=0, atol=2e-7)
    x = torch.randn(3, 128, generator=gen)
    ref = x.double() @ w.double().T + layer.bias.detach().double()
    assert ((layer(x).double() - ref).abs() <= _q8_bound(x, w)).all()
    from llminfer.models.quantizers import quantize_int4_groupwise

    assert quantize_int8_groupwise(torch.randn(0, 64), 32)[0].shape == (0, 64)  # a layer with no outputs
    assert quantize_int4_groupwise(torch.randn(0, 64), 32)[0].shape == (0, 64)
