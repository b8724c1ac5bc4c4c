"""The q8 path of llminfer's CPU kernels (``csrc/int8_linear_q8.cpp``, ``csrc/int4_linear_q8.cpp``): int8 and int4
weight-only products on 8-bit per-block activations, and the per-CPU choice between it and the wide path."""

from __future__ import annotations

import json

import pytest
import torch

from kernels_common import kernel_loaded, pytestmark  # noqa: F401  (the skip and the autouse fixture)
from llminfer.kernels import build, path_choice
from llminfer.kernels.linear import int8_linear
from llminfer.kernels.q8_linear import (
    int4_linear_q8,
    int8_linear_q8,
    pack_int4_codes_q8,
    unpack_int4_codes_q8,
)
from llminfer.models.weight_only import Int4WeightOnlyLinear, Int8WeightOnlyLinear


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The q8 rounding in torch: per block of 32 columns ``d = max|x| / 127`` (float32), ``q = round(x / d)``.
    Returns ``q`` float64 ``[M, K]`` and ``d`` float64 broadcast to ``[M, K]``."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    d = xb.abs().amax(2, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(xb))
    return q.clamp(-127, 127).reshape(m, k).double(), d.expand(-1, -1, 32).reshape(m, k).double()


def _int8_case(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 3] *= 20  # an outlier column, as LLM activations have
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return x, w, torch.rand(n, generator=g) / 50, torch.randn(n, generator=g)


@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 40])
@pytest.mark.parametrize("n, k", [(1, 32), (7, 512), (130, 64), (67, 1536), (6, 96), (5, 160)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_q8_is_the_block_scheme_and_within_the_rounding_bound(m, n, k, bias):
    x, w, scale, b = _int8_case(m, n, k, seed=m * 1000 + n + k)
    b = b if bias else None
    out = int8_linear_q8(x, w, scale, b).double()
    q, d = _blocks(x)
    wd = w.double() * scale.double()[:, None]
    bd = b.double() if bias else 0.0
    scheme = (q * d) @ wd.T + bd  # what the kernel computes, in float64
    exact = x.double() @ wd.T + bd
    # float32 steps only (lanes times d, the lane sum, scale, bias): relative to the sum of magnitudes
    mag = (q * d).abs() @ wd.abs().T + (b.double().abs() if bias else 0.0)
    assert ((out - scheme).abs() <= 1e-5 * mag + 1e-6).all()
    # the 8-bit activation rounding: at most d / 2 per element
    bound = (d / 2) @ wd.abs().T + 1e-5 * mag + 1e-6
    assert ((out - exact).abs() <= bound).all()


def test_int8_linear_q8_rows_are_batch_invariant_and_nan_rows_stay_theirs():
    x, w, scale, b = _int8_case(37, 70, 544, seed=1)
    x[5, 40] = float("nan")
    x[9, 500] = float("inf")
    out = int8_linear_q8(x, w, scale, b)
    assert out[5].isnan().all() and out[9].isnan().all()
    assert not out[[i for i in range(37) if i not in (5, 9)]].isnan().any()
    for rows in ([0], [0, 1], [4, 5, 6], list(range(8, 20)), list(range(37))):
        part = int8_linear_q8(x[rows].contiguous(), w, scale, b)
        torch.testing.assert_close(part, out[rows], rtol=0, atol=0, equal_nan=True)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.testing.assert_close(int8_linear_q8(x, w, scale, b), out, rtol=0, atol=0, equal_nan=True)
    finally:
        torch.set_num_threads(prev)
    zeros = int8_linear_q8(torch.zeros(2, 544), w, scale, b)
    torch.testing.assert_close(zeros, b.expand(2, -1), rtol=0, atol=0)


def _int4_case(m, n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = torch.rand(n, k // group, generator=g) / 50
    zero = torch.randn(n, k // group, generator=g) / 50
    return x, q, scale, zero, torch.randn(n, generator=g)


@pytest.mark.parametrize("m", [1, 3, 4, 9])
@pytest.mark.parametrize("n, k, group", [(1, 32, 32), (7, 512, 32), (13, 512, 64), (5, 1536, 128), (6, 512, 256),
                                         (4, 96, 32), (3, 640, 64), (2, 160, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_q8_is_the_block_scheme_and_within_the_rounding_bound(m, n, k, group, bias):
    x, q, scale, zero, b = _int4_case(m, n, k, group, seed=m + n + k + group)
    b = b if bias else None
    out = int4_linear_q8(x, pack_int4_codes_q8(q), scale, zero, group, b).double()
    qx, d = _blocks(x)
    sw = q.double() * scale.double().repeat_interleave(group, 1)
    zw = zero.double().repeat_interleave(group, 1)
    bd = b.double() if bias else 0.0
    scheme = (qx * d) @ sw.T + x.double() @ zw.T + bd  # zero points' term on the float activations
    exact = x.double() @ (sw + zw).T + bd
    mag = (qx * d).abs() @ sw.abs().T + x.double().abs() @ zw.abs().T + (b.double().abs() if bias else 0.0)
    assert ((out - scheme).abs() <= 1e-5 * mag + 1e-6).all()
    assert ((out - exact).abs() <= (d / 2) @ sw.abs().T + 1e-5 * mag + 1e-6).all()


def test_int4_linear_q8_rows_are_batch_invariant_and_nan_rows_stay_theirs():
    x, q, scale, zero, b = _int4_case(21, 30, 384, 64, seed=3)
    x[2, 7] = float("nan")
    codes = pack_int4_codes_q8(q)
    out = int4_linear_q8(x, codes, scale, zero, 64, b)
    assert out[2].isnan().all() and not out[[i for i in range(21) if i != 2]].isnan().any()
    for rows in ([0], [1, 2, 3], list(range(5, 18))):
        part = int4_linear_q8(x[rows].contiguous(), codes, scale, zero, 64, b)
        torch.testing.assert_close(part, out[rows], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("n, k", [(5, 32), (3, 96), (17, 512), (2, 640)])
def test_int4_q8_codes_round_trip(n, k):
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = pack_int4_codes_q8(q)
    assert packed.shape == (n, -(-k // 128) * 64) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4_codes_q8(packed, k), q)


@pytest.mark.parametrize("args, match", [
    ((torch.randn(2, 48), torch.zeros(3, 48, dtype=torch.int8), torch.ones(3)), "multiple of 32"),
    ((torch.randn(2, 64), torch.zeros(3, 64), torch.ones(3)), "int8"),
    ((torch.randn(2, 64), torch.zeros(3, 32, dtype=torch.int8), torch.ones(3)), "x's K"),
    ((torch.randn(2, 64), torch.zeros(3, 64, dtype=torch.int8), torch.ones(4)), "scale"),
    ((torch.randn(2, 64).double(), torch.zeros(3, 64, dtype=torch.int8), torch.ones(3)), "float32"),
])
def test_int8_linear_q8_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        int8_linear_q8(*args)


@pytest.mark.parametrize("args, match", [
    ((torch.randn(2, 64), torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2), torch.ones(4, 2), 48), "group_size"),
    ((torch.randn(2, 64), torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2), torch.ones(4, 2), 32), "codes"),
    ((torch.randn(2, 64), torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 3), torch.ones(4, 2), 32), "scale"),
])
def test_int4_linear_q8_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        int4_linear_q8(*args)


def test_layers_run_the_path_they_were_given():
    g = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(256, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 256, generator=g) / 16)
    x = torch.randn(3, 256, generator=g)
    i8 = Int8WeightOnlyLinear(lin)
    i8.use_cpu_kernel, i8.kernel_path = True, "q8"
    want = int8_linear_q8(x, i8.weight, i8.scales.float(), lin.bias.detach().float())
    torch.testing.assert_close(i8(x), want, rtol=0, atol=0)
    i8.kernel_path = "wide"
    torch.testing.assert_close(i8(x), int8_linear(x, i8.weight, i8.scales.float(), lin.bias.detach().float()),
                               rtol=0, atol=0)
    i4 = Int4WeightOnlyLinear(lin, group_size=64)
    codes = i4.codes()
    with pytest.raises(ValueError, match="path"):
        i4.use_llminfer_kernel("fast")
    i4.use_llminfer_kernel("q8")
    assert i4.kernel_path == "q8" and torch.equal(i4.codes(), codes)
    dense = i4.dequantized_weight().double()
    out = i4(x).double()
    _, d = _blocks(x)
    bound = (d / 2) @ dense.abs().T + 1e-4
    assert ((out - (x.double() @ dense.T + lin.bias.detach().double())).abs() <= bound).all()


def test_paths_follow_the_environment(monkeypatch):
    monkeypatch.setenv(path_choice.INT8_PATH_ENV, "q8")
    monkeypatch.setenv(path_choice.INT4_PATH_ENV, "WIDE")
    paths = path_choice.quant_paths()
    assert paths["int8"] == {"path": "q8", "how": "forced"} and paths["int4"] == {"path": "wide", "how": "forced"}
    assert paths["int8-group"] == {"path": "q8", "how": "forced"}
    monkeypatch.setenv(path_choice.INT8_PATH_ENV, "fastest")
    with pytest.raises(ValueError, match=path_choice.INT8_PATH_ENV):
        path_choice.quant_paths()


def test_measured_paths_are_kept_with_the_build(monkeypatch, tmp_path):
    monkeypatch.delenv(path_choice.INT8_PATH_ENV, raising=False)
    monkeypatch.delenv(path_choice.INT4_PATH_ENV, raising=False)
    monkeypatch.setattr(build, "_cache_dir", lambda isa="avx2": tmp_path)
    calls = []

    def fake_measure():
        calls.append(1)
        return {"int8": {"path": "q8", "how": "measured", "q8_ms": 1.0, "wide_ms": 2.0, "wide": "int8_linear"},
                "int8-group": {"path": "q8", "how": "measured", "q8_ms": 1.0, "wide_ms": 2.0,
                               "wide": "int8_group_linear"},
                "int4": {"path": "wide", "how": "measured", "q8_ms": 3.0, "wide_ms": 2.0, "wide": "int4_linear"}}

    monkeypatch.setattr(path_choice, "_measure_paths", fake_measure)
    monkeypatch.delitem(build._state, "paths", raising=False)
    first = path_choice.quant_paths()
    assert first["int8"]["path"] == "q8" and first["int4"]["path"] == "wide" and len(calls) == 1
    kept = json.loads((tmp_path / path_choice.PATHS_FILE).read_text())
    assert kept["paths"]["int8"]["q8_ms"] == 1.0 and kept["threads"] == torch.get_num_threads()
    monkeypatch.delitem(build._state, "paths")  # a new process: read from the build folder
    assert path_choice.quant_paths() == first and len(calls) == 1
    monkeypatch.delitem(build._state, "paths")
    first_cpu = kept["cpu"]
    kept["cpu"] = "another CPU"
    (tmp_path / path_choice.PATHS_FILE).write_text(json.dumps(kept))
    path_choice.quant_paths()
    assert len(calls) == 2  # measured again: the kept choice was another CPU's
    monkeypatch.delitem(build._state, "paths")
    kept["cpu"] = first_cpu
    kept["q8_max_time_ratio"] = 1.0
    (tmp_path / path_choice.PATHS_FILE).write_text(json.dumps(kept))
    path_choice.quant_paths()
    assert len(calls) == 3  # measured again: the kept choice was made by another rule
    monkeypatch.delitem(build._state, "paths")


def test_measurement_times_both_paths():
    found = path_choice._measure_paths()
    for kind in ("int8", "int8-group", "int4"):
        v = found[kind]
        assert v["path"] in path_choice.QUANT_PATHS and v["q8_ms"] > 0 and v["wide_ms"] > 0
        # one 8-bit digit (int8 per channel) costs accuracy: taken only for a clear speed-up; the group kinds'
        # two digits do not, so the faster is taken
        ratio = path_choice.Q8_MAX_TIME_RATIO if kind == "int8" else 1.0
        assert v["path"] == ("q8" if v["q8_ms"] <= ratio * v["wide_ms"] else "wide")
