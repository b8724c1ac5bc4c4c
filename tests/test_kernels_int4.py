"""The int4 product (``llminfer.kernels.int4_linear``, AVX-512 VNNI) against its scheme, its batch invariance and
checks, the code layout round trip, and the int4-wo layer moved onto it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels_common import kernel_loaded, pytestmark  # noqa: F401  (the skip and the autouse fixture)
from llminfer.kernels import build
from llminfer.kernels.int4_linear import int4_linear
from llminfer.models.kernel_swap import enable_cpu_kernels


def _integer_path() -> bool:
    """Whether int8 products run on the VNNI build's integer path here."""
    assert build.skinny_linear_available(), build.unavailable_reason()
    return build.int8_activation_bits() == 14


def _int4_case(n, k, group, seed):
    from llminfer.kernels.int4_linear import pack_int4_codes

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = torch.rand(n, k // group, generator=g) / 20
    zero = torch.randn(n, k // group, generator=g) / 10
    return q, pack_int4_codes(q), scale, zero


def _int4_dense(q, scale, zero, group):
    return q.double() * scale.double().repeat_interleave(group, 1) + zero.double().repeat_interleave(group, 1)


needs_int_path = pytest.mark.skipif(build.target_isa() != "avx512" or not build.vnni_wanted(),
                                    reason="no AVX-512 VNNI path here (int4 stays on torch's kernel)")


@needs_int_path
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("n, k, group", [(1, 32, 32), (7, 512, 32), (13, 512, 64), (5, 1536, 128), (6, 512, 256),
                                         (9, 96, 32), (4, 160, 32), (3, 192, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_matches_the_scheme(m, n, k, group, bias):
    """Against float64 on the same 14-bit rounded activations: only float32 summation error; against the
    float activations: within the rounding's bound (as int8_linear). K that is not a multiple of 128 (a
    short last run of codes) included."""
    assert _integer_path()
    q, codes, scale, zero = _int4_case(n, k, group, m * 7 + n + k + group)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * 3
    b = torch.randn(n, generator=g) if bias else None
    out = int4_linear(x, codes, scale, zero, group, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    w = _int4_dense(q, scale, zero, group)
    sx = x.abs().amax(1, keepdim=True) / 8191  # float32, as the kernel rounds (see _int8_integer_ref)
    xq = torch.round(x / sx).clamp(-8191, 8191).double() * sx.double()
    sx = sx.double()
    exact = xq @ w.T + (b.double() if bias else 0)
    magnitude = xq.abs() @ w.abs().T
    assert ((out.double() - exact).abs() <= 1e-5 * magnitude + 1e-6).all()
    bound = 0.5 * sx * w.abs().sum(1)[None, :]
    want = x.double() @ w.T + (b.double() if bias else 0)
    assert ((out.double() - want).abs() <= bound + 1e-5 * magnitude + 1e-6).all()


@needs_int_path
def test_int4_linear_rows_are_batch_invariant_and_nan_rows_stay_theirs():
    assert _integer_path()
    q, codes, scale, zero = _int4_case(131, 512, 32, 0)
    g = torch.Generator().manual_seed(2)
    b = torch.randn(131, generator=g)
    row = torch.randn(1, 512, generator=g)
    alone = int4_linear(row, codes, scale, zero, 32, b)
    threads = torch.get_num_threads()
    try:
        for num_threads, m, at in ((1, 7, 5), (threads, 8, 7), (threads, 9, 8), (threads, 33, 17), (threads, 300, 150),
                                   (1, 300, 299)):
            torch.set_num_threads(num_threads)
            x = torch.randn(m, 512, generator=g)
            x[at] = row[0]
            x[(at + 1) % m, 3] = float("nan")
            out = int4_linear(x, codes, scale, zero, 32, b)
            assert torch.equal(out[at], alone[0]), (num_threads, m, at)
            assert torch.isnan(out[(at + 1) % m]).all()
    finally:
        torch.set_num_threads(threads)


@needs_int_path
@pytest.mark.parametrize("args, match", [
    ((torch.randn(2, 64), torch.zeros(3, 64, dtype=torch.uint8), torch.rand(3, 2), torch.rand(3, 2), 48), "group_size"),
    ((torch.randn(2, 64), torch.zeros(3, 64, dtype=torch.uint8), torch.rand(3, 2), torch.rand(3, 2), 128), "divide K"),
    ((torch.randn(2, 64), torch.zeros(3, 32, dtype=torch.uint8), torch.rand(3, 2), torch.rand(3, 2), 32), "codes"),
    ((torch.randn(2, 64), torch.zeros(3, 64, dtype=torch.uint8), torch.rand(3, 1), torch.rand(3, 2), 32), "scale and zero"),
    ((torch.randn(2, 64).double(), torch.zeros(3, 64, dtype=torch.uint8), torch.rand(3, 2), torch.rand(3, 2), 32), "float32"),
    ((torch.randn(2, 64), torch.zeros(3, 64, dtype=torch.uint8), torch.rand(3, 2), torch.rand(3, 2), 32, torch.rand(2)),
     "bias"),
])
def test_int4_linear_rejects_bad_arguments(args, match):
    assert _integer_path()
    with pytest.raises(RuntimeError, match=match):
        int4_linear(*args)


@pytest.mark.parametrize("n, k", [(5, 32), (3, 96), (17, 512), (2, 640)])
def test_int4_codes_round_trip(n, k):
    from llminfer.kernels.int4_linear import pack_int4_codes, unpack_int4_codes

    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = pack_int4_codes(q)
    assert packed.dtype == torch.uint8 and packed.shape == (n, -(-k // 128) * 64)
    assert torch.equal(unpack_int4_codes(packed, k), q)


@needs_int_path
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_int4_layer_moves_to_the_kernel_with_the_same_codes(group):
    """``enable_cpu_kernels`` re-lays an int4-wo layer's codes out for the kernel (read back exactly from
    torch's packed layout, out_features not a multiple of 16 included) and the layer then computes the
    product of its dequantized weight at any row count, closer than torch's bf16-activation kernel."""
    from llminfer.kernels import int8_group_linear as int8_group
    from llminfer.models.weight_only import Int4WeightOnlyLinear, dequantize_int4, quantize_int4_groupwise

    torch.manual_seed(group)
    lin = nn.Linear(512, 37)
    layer = Int4WeightOnlyLinear(lin, group)
    q, sz = quantize_int4_groupwise(lin.weight, group)
    assert torch.equal(layer.codes(), q)
    x = torch.randn(2, 20, 512)
    with torch.inference_mode():
        before = layer(x)
        assert enable_cpu_kernels(nn.Sequential(layer)) == 1 and layer.use_cpu_kernel
        if layer.kernel_path == "q8" and group == 32:  # int4_group_linear_q8's blocks of L channels
            lanes = int8_group.group_q8_lanes()
            assert layer.weight.shape == (-(-37 // lanes), lanes * 256)
        else:
            assert layer.weight.shape == (37, 256)
        assert torch.equal(layer.codes(), q)
        after = layer(x)
        # the quantizer's own grid (torch's layout rounded its zero points to bfloat16)
        want = F.linear(x.double(), dequantize_int4(q, sz, group).double(), lin.bias.double())
        torch.testing.assert_close(layer.dequantized_weight().double(), dequantize_int4(q, sz, group).double(),
                                   atol=1e-6, rtol=1e-6)
        if layer.kernel_path == "q8" and group == 32:  # its bfloat16 scales and minima in 2 bytes each
            assert layer.kernel_scales.dtype == layer.kernel_zeros.dtype == torch.bfloat16
        assert layer._kernel_grid is None and layer._kernel_codes is None  # the kept copies are dropped
        assert "scales_and_zeros" not in layer.state_dict()  # the kernel's scales replace torch's
    err_after, err_before = (after.double() - want).abs().max(), (before.double() - want).abs().max()
    if layer.kernel_path == "q8":  # 8-bit block activations: within their rounding bound (test_kernels_q8)
        xb = x.reshape(40, 16, 32).double()
        half_step = (xb.abs().amax(2, keepdim=True) / 254).expand(-1, -1, 32).reshape(40, 512)
        bound = half_step @ layer.dequantized_weight().double().abs().T + 1e-4
        assert ((after.double() - want).reshape(40, 37).abs() <= bound).all()
    else:
        assert err_after < 2e-3 and err_after < err_before
    layer.use_llminfer_kernel()  # idempotent
    assert torch.equal(layer.codes(), q)


@needs_int_path
def test_int4_kernel_layout_state_dict_round_trips_and_refuses_the_other_layout():
    """The kernel layout's state (codes, float32 scales and zero points) is all in buffers: a state_dict
    loads into another kernel-layout layer and gives its outputs; into a torch-layout layer it is refused
    (other keys), never silently mixed; quantized_bytes counts what the kernel reads."""
    from llminfer.models.weight_only import Int4WeightOnlyLinear

    torch.manual_seed(0)
    a, b = Int4WeightOnlyLinear(nn.Linear(160, 20), 32), Int4WeightOnlyLinear(nn.Linear(160, 20), 32)
    torch_layout = Int4WeightOnlyLinear(nn.Linear(160, 20), 32)
    a.use_llminfer_kernel()
    b.use_llminfer_kernel()
    x = torch.randn(3, 160)
    with torch.inference_mode():
        want = b(x)
        a.load_state_dict(b.state_dict())
        assert torch.equal(a(x), want)
        torch.testing.assert_close(a(x), F.linear(x, a.dequantized_weight(), a.bias), atol=2e-3, rtol=1e-3)
    with pytest.raises(RuntimeError, match="kernel_scales|scales_and_zeros"):
        torch_layout.load_state_dict(a.state_dict())
    with pytest.raises(RuntimeError, match="kernel_scales|scales_and_zeros"):
        a.load_state_dict(torch_layout.state_dict())
    assert a.quantized_bytes() == sum(t.numel() * t.element_size() for t in (a.weight, a.kernel_scales, a.kernel_zeros))


@needs_int_path
def test_a_torch_layout_state_loaded_later_is_what_the_kernel_computes():
    """The quantizer's grid kept for the kernel is the layer's own: after load_state_dict of another
    torch-layout layer, use_llminfer_kernel takes the loaded scales and zero points, not the kept grid."""
    from llminfer.models.weight_only import Int4WeightOnlyLinear

    torch.manual_seed(1)
    shifted = [nn.Linear(160, 20), nn.Linear(160, 20)]
    with torch.no_grad():
        for linear in shifted:  # groups far from 0: zero points (minimum + 8 * scale) that are not bfloat16 values
            linear.weight.add_(1.0)
    source, target = Int4WeightOnlyLinear(shifted[0], 32), Int4WeightOnlyLinear(shifted[1], 32)
    assert source._kernel_grid is not None and target._kernel_grid is not None
    want = source.dequantized_weight()  # torch's layout: the bfloat16 zero points
    target.load_state_dict(source.state_dict())
    target.use_llminfer_kernel("q8")
    torch.testing.assert_close(target.dequantized_weight(), want, rtol=0, atol=1e-6)
    source.use_llminfer_kernel("q8")  # its own kept grid: the quantizer's minima, not torch's rounded zeros
    assert not torch.equal(source.dequantized_weight(), want)


@needs_int_path
def test_int4_empty_k_and_a_2d_bias_are_errors():
    assert _integer_path()
    with pytest.raises(RuntimeError, match="divide K"):
        int4_linear(torch.randn(2, 0), torch.zeros(4, 0, dtype=torch.uint8), torch.zeros(4, 0),
                                torch.zeros(4, 0), 32)
    with pytest.raises(RuntimeError, match="bias"):
        int4_linear(torch.randn(2, 64), torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 2),
                                torch.zeros(4, 2), 32, torch.zeros(4, 1))
