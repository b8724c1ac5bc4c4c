"""int4-wo's 6-bit LM head (llminfer.models.weight_only_int6, csrc/int8_group_linear_q8.cpp's 6-bit codes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llminfer.kernels import int8_group_linear as grp

pytestmark = pytest.mark.skipif(not grp.kernel_available(), reason="llminfer's CPU kernel does not build here")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), groups=st.integers(1, 5), rows=st.integers(1, 9), seed=st.integers(0, 2**16),
       bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_6_bit_codes_give_the_int8_kernels_bits_on_the_same_codes(n, groups, rows, seed, bias, dtype):
    """The layout round-trips, and the product on 6-bit codes is the int8 kernel's on the same codes, bit for
    bit (the same integer sums and float order; only the unpacking differs), for any rows, channels (a last
    block part-filled) and parameter dtype."""
    g = torch.Generator().manual_seed(seed)
    k = 32 * groups
    codes = torch.randint(0, 64, (n, k), generator=g)
    scale = torch.rand(n, groups, generator=g).to(dtype).float()
    minimum = torch.randn(n, groups, generator=g).to(dtype).float()
    b = torch.randn(n, generator=g) if bias else None
    packed = grp.pack_int6_group_q8(codes)
    assert packed.shape[1] == 3 * grp.group_q8_lanes() * k // 4
    assert torch.equal(grp.unpack_int6_group_q8(packed, n), codes.to(torch.int32))
    s, z = grp.pack_group_q8_params(scale, dtype), grp.pack_group_q8_params(minimum, dtype)
    x = torch.randn(rows, k, generator=g) * 3
    six = torch.ops.llminfer_cpu.int6_group_linear_q8(x, packed, s, z, n, b)
    eight = torch.ops.llminfer_cpu.int8_group_linear_q8(x, grp.pack_int8_group_q8(codes.to(torch.uint8)), s, z, n, b)
    assert torch.equal(six, eight)
    assert torch.equal(six[-1:], torch.ops.llminfer_cpu.int6_group_linear_q8(x[-1:].contiguous(), packed, s, z, n, b))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), groups=st.integers(1, 4), seed=st.integers(0, 2**16), spread=st.floats(1e-3, 10.0))
def test_the_6_bit_grid_covers_each_group_within_half_a_step(n, groups, seed, spread):
    """Codes in [0, 63]; every weight within half its group's step of ``code * scale + minimum`` (the scale
    rounded up and the minimum down to bfloat16 values, so the grid still covers the group)."""
    w = torch.randn(n, 32 * groups, generator=torch.Generator().manual_seed(seed)) * spread
    codes, scale, minimum = grp.quantize_int6_groupwise(w)
    assert int(codes.max()) <= 63
    assert grp.is_exact_in(scale, torch.bfloat16) and grp.is_exact_in(minimum, torch.bfloat16)
    err = (grp.dequantize_int8_groupwise(codes, scale, minimum) - w).abs().reshape(n, groups, 32)
    assert bool((err <= scale[..., None] * (0.5 + 1e-5)).all())


def test_the_head_module_computes_its_dequantized_weight_and_counts_its_bytes():
    """The module's product is the float product with its dequantized weight up to the activations' rounding;
    its bytes are 6 bits a weight plus two bfloat16 values a group (padded to the lanes); ``quantize_model``
    puts it on an int4-wo head only; the op traces under torch.compile (its fake)."""
    from llminfer.models.weight_only import quantize_model
    from llminfer.models.weight_only_int6 import Int6GroupWeightOnlyLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 80, bias=True)
    head = Int6GroupWeightOnlyLinear(linear)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        out = head(x)
        ref = x @ head.dequantized_weight().T + linear.bias.detach()
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
    lanes = grp.group_q8_lanes()
    padded = -(-80 // lanes) * lanes
    assert head.quantized_bytes() == padded * 64 * 6 // 8 + 2 * 2 * padded * 2
    compiled = torch.compile(lambda t: head(t), fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(x), out)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    assert quantize_model(model, "int4-wo")["quantized"] and not isinstance(model[0], Int6GroupWeightOnlyLinear)
