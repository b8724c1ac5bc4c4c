"""The compiled backend held to eager: compare's note where it is slower, and its CPU LM head."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from llminfer.benchmark.results import ComparisonResult, slower_than_eager


def _result(tps: dict[int, float]) -> SimpleNamespace:
    return SimpleNamespace(configs=[{"batch_size": b, "output_tokens_per_s": v} for b, v in tps.items()])


def test_a_note_for_each_batch_where_compiled_is_slower():
    res = ComparisonResult({"eager": _result({1: 40.0, 8: 280.0, 32: 550.0}),
                            "compiled": _result({1: 50.0, 8: 30.0, 32: 549.0})}, {}, {})
    notes = slower_than_eager(res)
    assert len(notes) == 2
    assert notes[0].startswith("compiled is slower than eager at batch 8 (30.0 vs 280.0") and "x0.107" in notes[0]
    assert "batch 32" in notes[1] and "x0.998" in notes[1]  # a 0.2 % gap still reads as one
    assert slower_than_eager(ComparisonResult({"compiled": _result({1: 1.0})}, {}, {})) == []


def test_the_compiled_backends_cpu_head_takes_the_kernel_for_a_few_rows_and_the_packed_gemm_beyond():
    import pytest
    import torch

    from llminfer.backends.compiled import cpu_head
    from llminfer.kernels.build import skinny_linear_available
    from llminfer.kernels.layers import SkinnyLinear
    from llminfer.kernels.linear import skinny_linear
    from llminfer.kernels.prepack import FP32_HEAD_KERNEL_MAX_ROWS, PrepackedLinear, prepack_supported

    if not (skinny_linear_available() and prepack_supported(torch.float32, torch.device("cpu"))):
        pytest.skip("needs llminfer's CPU kernel and oneDNN")
    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 96, bias=False)
    head = cpu_head(SkinnyLinear(plain))
    assert isinstance(head, PrepackedLinear) and head.kernel_rows == FP32_HEAD_KERNEL_MAX_ROWS
    with torch.inference_mode():
        for rows in (1, FP32_HEAD_KERNEL_MAX_ROWS, FP32_HEAD_KERNEL_MAX_ROWS + 1, 8):
            x = torch.randn(rows, 64)
            out = head(x)
            torch.testing.assert_close(out, x @ plain.weight.T, rtol=1e-4, atol=1e-4)
            # which product ran: the kernel's bits, or oneDNN's on the packed weight
            want = (skinny_linear(x, plain.weight) if rows <= FP32_HEAD_KERNEL_MAX_ROWS else
                    torch.ops.mkldnn._linear_pointwise(x, head._packed_weight(), None, "none", [], ""))
            assert torch.equal(out, want), rows
    assert head.weight is plain.weight  # no second plain copy of the weight
    plain_head = cpu_head(torch.nn.Linear(64, 96))  # not on the kernel: the packed GEMM at every row count
    assert isinstance(plain_head, PrepackedLinear) and plain_head.kernel_rows == 0
    assert cpu_head(torch.nn.Identity()).__class__ is torch.nn.Identity  # not a linear head: unchanged


def test_settle_compile_workers_waits_for_inductors_pool_and_is_a_no_op_without_one(monkeypatch):
    import concurrent.futures
    import threading

    from torch._inductor.async_compile import AsyncCompile

    from llminfer.backends.compiled import settle_compile_workers

    monkeypatch.setattr(AsyncCompile, "_ready_future", None, raising=False)
    settle_compile_workers(timeout_s=0.01)  # no pool started: returns at once
    pending: concurrent.futures.Future = concurrent.futures.Future()
    monkeypatch.setattr(AsyncCompile, "_ready_future", pending, raising=False)
    waited = threading.Event()

    def wait() -> None:
        settle_compile_workers(timeout_s=30)
        waited.set()

    t = threading.Thread(target=wait)
    t.start()
    assert not waited.wait(0.2)  # still waiting for the pool
    pending.set_result("ready")
    t.join(30)
    assert waited.is_set()
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(RuntimeError("pool died"))
    monkeypatch.setattr(AsyncCompile, "_ready_future", failed, raising=False)
    settle_compile_workers()  # a broken pool is not the step's problem


def test_small_hosts_compile_in_process_without_a_worker_pool(monkeypatch):
    """On a host of few CPUs the compile workers' start-up would share the cores with the next steps."""
    from llminfer.backends import compile_config

    monkeypatch.setattr(compile_config.os, "cpu_count", lambda: 2)
    assert compile_config.inductor_options("default", False, torch.device("cpu"))["compile_threads"] == 1
    monkeypatch.setattr(compile_config.os, "cpu_count", lambda: 64)
    assert "compile_threads" not in compile_config.inductor_options("default", False, torch.device("cpu"))


def test_cpu_graphs_get_inductors_cpp_wrapper_unless_switched_off(monkeypatch):
    """On CPU the compiled graph's wrapper is C++ (no Python call per kernel); $LLMINFER_COMPILE_CPP_WRAPPER=0
    keeps the Python one; other devices are left alone."""
    from llminfer.backends import compile_config

    monkeypatch.delenv(compile_config.CPP_WRAPPER_ENV, raising=False)
    assert compile_config.inductor_options("default", False, torch.device("cpu"))["cpp_wrapper"] is True
    assert "cpp_wrapper" not in compile_config.inductor_options("default", False, torch.device("cuda"))
    monkeypatch.setenv(compile_config.CPP_WRAPPER_ENV, "0")
    assert "cpp_wrapper" not in compile_config.inductor_options("default", False, torch.device("cpu"))
