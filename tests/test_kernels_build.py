"""Building and loading llminfer's CPU kernel library (``llminfer.kernels.build``): the ISA and flags it
is built for, its cache key, its lock, the fallback where it cannot be built, the ops under torch.compile,
and the engine wiring (``engine.info()``, ``cpu_kernels=False``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_kernels_attention import _paged_step
from torch import nn

from helpers import make_engine
from kernels_common import kernel_loaded, pytestmark  # noqa: F401  (the skip and the autouse fixture)
from llminfer.kernels import build
from llminfer.kernels.layers import SkinnyLinear
from llminfer.models.kernel_swap import enable_cpu_kernels
from llminfer.models.weight_only import Int8WeightOnlyLinear


def test_kernel_builds_here():
    assert build.skinny_linear_available(), build.unavailable_reason()


def test_engine_reports_and_honours_the_switch(model_dirs):
    with make_engine(model_dirs["qwen2"], max_batch_size=2) as engine:
        info = engine.info()
        assert info["attention_backend"] == "cpu"
        assert info["cpu_kernel"].startswith("skinny_linear on ") and engine.runtime.cpu_kernel_layers > 0
        assert f"({build.vector_isa()}, " in info["cpu_kernel"]
        threads = "llminfer's worker threads" if build.kernel_threads() == "llminfer" else "OpenMP threads"
        assert info["cpu_kernel"].endswith(f"; {threads})"), info["cpu_kernel"]
        on = engine.run("kernels on", max_new_tokens=6, ignore_eos=True).token_ids
    with make_engine(model_dirs["qwen2"], max_batch_size=2, cpu_kernels=False) as engine:
        info = engine.info()
        assert info["attention_backend"] == "torch" and info["cpu_kernel"] == "off (cpu_kernels=False)"
        assert not any(isinstance(m, SkinnyLinear) for m in engine.runtime.model.modules())
        assert engine.run("kernels on", max_new_tokens=6, ignore_eos=True).token_ids == on


def test_unbuildable_kernel_falls_back_to_torch(model_dirs, monkeypatch):
    """No compiler (the build raises): one warning, 0 layers swapped, torch attention, same tokens."""
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'llminfer_cpu_kernels'\nc++: not found")

    with make_engine(model_dirs["qwen2"], max_batch_size=2) as engine:
        want = engine.run("fallback", max_new_tokens=6, ignore_eos=True).token_ids
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    build._reset_for_tests()
    try:
        assert not build.skinny_linear_available()
        assert "c++: not found" in build.unavailable_reason()
        with make_engine(model_dirs["qwen2"], max_batch_size=2) as engine:
            info = engine.info()
            assert info["attention_backend"] == "torch" and info["cpu_kernel"].startswith("off (build failed")
            assert engine.run("fallback", max_new_tokens=6, ignore_eos=True).token_ids == want
    finally:
        monkeypatch.undo()
        build._reset_for_tests()
        assert build.skinny_linear_available()


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv(build.DISABLE_ENV, "0")
    build._reset_for_tests()
    try:
        assert not build.skinny_linear_available()
        assert build.unavailable_reason() == f"{build.DISABLE_ENV}=0"
    finally:
        monkeypatch.undo()
        build._reset_for_tests()


def test_build_folder_follows_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMINFER_CACHE_DIR", str(tmp_path))
    assert build._cache_dir().parent == tmp_path / "cpu_kernels"


def test_a_first_build_is_announced_and_a_built_one_is_not(tmp_path, capfd):
    with build._announce_build(tmp_path, "avx2"):
        pass
    err = capfd.readouterr().err
    assert "building its CPU kernels once for this CPU class (avx2)" in err and "built the CPU kernels in" in err
    (tmp_path / "llminfer_cpu_kernels.so").write_bytes(b"")
    with build._announce_build(tmp_path, "avx2"):
        pass
    assert capfd.readouterr().err == ""


def test_build_isa_follows_the_switch_and_the_cpu_flags(monkeypatch):
    """AVX-512 where the CPU has all four of F/BW/DQ/VL (the build then passes their -m flags), else AVX2;
    ``LLMINFER_CPU_KERNEL_ISA=avx2`` forces AVX2; the two builds live in different folders."""
    partial = {"avx2", "fma", "avx512f"}  # F alone (no BW/DQ/VL) is not enough
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    monkeypatch.setattr(build, "cpu_flags", lambda: partial | build.AVX512_CPU_FLAGS)
    assert build.target_isa() == build.best_isa() == "avx512"
    for value, want in (("avx2", "avx2"), (" AVX2 ", "avx2"), ("avx512", "avx512"), ("auto", "avx512")):
        monkeypatch.setenv(build.ISA_ENV, value)
        assert build.target_isa() == want, value
    monkeypatch.setattr(build, "cpu_flags", lambda: partial)
    for value in ("avx512", "auto", "avx2"):
        monkeypatch.setenv(build.ISA_ENV, value)
        assert build.target_isa() == "avx2", value
    monkeypatch.delenv(build.ISA_ENV)
    assert build.target_isa() == build.best_isa() == "avx2"
    assert "-mavx512f" in build.build_cflags("avx512") and "-mavx512f" not in build.build_cflags("avx2")
    assert build._cache_dir("avx512") != build._cache_dir("avx2")


def test_vnni_joins_the_avx512_build_where_the_cpu_has_it(monkeypatch):
    """``-mavx512vnni`` (int8 on integer dot products) only in the AVX-512 build, only where the CPU has
    ``avx512_vnni``, and not with ``LLMINFER_CPU_KERNEL_VNNI=0``; each choice builds in its own folder."""
    base = {"avx2", "fma"} | build.AVX512_CPU_FLAGS
    monkeypatch.delenv(build.VNNI_ENV, raising=False)
    monkeypatch.setattr(build, "cpu_flags", lambda: base | {"avx512_vnni"})
    with_vnni = build._cache_dir("avx512")
    assert "-mavx512vnni" in build.build_cflags("avx512") and "-mavx512vnni" not in build.build_cflags("avx2")
    monkeypatch.setenv(build.VNNI_ENV, "0")
    assert "-mavx512vnni" not in build.build_cflags("avx512") and build._cache_dir("avx512") != with_vnni
    monkeypatch.delenv(build.VNNI_ENV)
    monkeypatch.setattr(build, "cpu_flags", lambda: base)
    assert "-mavx512vnni" not in build.build_cflags("avx512")


def test_bf16_joins_the_avx512_build_where_the_cpu_has_it(monkeypatch):
    """``-mavx512bf16`` (bf16 products on vdpbf16ps) only in the AVX-512 build and only where the CPU has
    ``avx512_bf16``; each choice builds in its own folder."""
    base = {"avx2", "fma"} | build.AVX512_CPU_FLAGS
    monkeypatch.setattr(build, "cpu_flags", lambda: base | {"avx512_bf16"})
    with_bf16 = build._cache_dir("avx512")
    assert "-mavx512bf16" in build.build_cflags("avx512") and "-mavx512bf16" not in build.build_cflags("avx2")
    monkeypatch.setattr(build, "cpu_flags", lambda: base)
    assert "-mavx512bf16" not in build.build_cflags("avx512") and build._cache_dir("avx512") != with_bf16


def test_loaded_build_matches_the_switch():
    assert build.skinny_linear_available(), build.unavailable_reason()
    want = "AVX-512" if build.target_isa() == "avx512" else "AVX2"
    assert build.vector_isa() == want


_OTHER_BUILD_CHECK = """
import math, sys, torch
from llminfer.kernels import build
from llminfer.kernels.bf16_linear import bf16_linear
from llminfer.kernels.int4_linear import int4_linear
from llminfer.kernels.linear import int8_linear, skinny_linear
assert build.skinny_linear_available(), build.unavailable_reason()
assert build.vector_isa() == sys.argv[1], build.vector_isa()
g = torch.Generator().manual_seed(0)
for m, n, k in [(1, 7, 520), (5, 130, 64), (33, 4, 8), (4, 13, 24)]:  # K % 16 == 8 ends in half a vector
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    q, s = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g)
    ref = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(skinny_linear(x, w, None, b).double(), ref, atol=1e-4 * k**0.5, rtol=1e-5)
    ref = x.double() @ (q.double() * s.double()[:, None]).T
    torch.testing.assert_close(skinny_linear(x, q, s).double(), ref, atol=1e-4 * k**0.5, rtol=1e-5)
    assert torch.equal(skinny_linear(x, w)[m - 1], skinny_linear(x[m - 1:], w)[0])
    assert torch.equal(skinny_linear(x, q, s, b)[m - 1], skinny_linear(x[m - 1:], q, s, b)[0])
    assert torch.equal(int8_linear(x, q, s, b)[m - 1], int8_linear(x[m - 1:], q, s, b)[0])
    if build.int8_activation_bits() is None:  # no integer path in this build: int8_linear is skinny_linear
        assert torch.equal(int8_linear(x, q, s, b), skinny_linear(x, q, s, b))
for d in (24, 64):  # decode attention, head_dim 24 ends in half a vector
    B, H, HKV, NB, BS = 3, 4, 2, 6, 4
    q = torch.randn(B, H, d, generator=g)
    kc, vc = torch.randn(HKV, NB, BS, d, generator=g), torch.randn(HKV, NB, BS, d, generator=g)
    tables = torch.tensor([[5, 0, 3], [1, 2, 4], [4, 0, 0]])
    lens = torch.tensor([11, 9, 1])
    kc, vc = (kc, vc) if d == 64 else (kc.bfloat16(), vc.bfloat16())  # a bf16 cache, widened as it is read
    out = torch.ops.llminfer_cpu.paged_decode_attention(q, kc, vc, tables, lens, 1 / math.sqrt(d))
    for bi in range(B):
        slots = [(int(tables[bi, t // BS]), t % BS) for t in range(int(lens[bi]))]
        for h in range(H):
            kv = h // (H // HKV)
            keys = torch.stack([kc[kv, blk, off] for blk, off in slots]).double()
            vals = torch.stack([vc[kv, blk, off] for blk, off in slots]).double()
            p = torch.softmax(keys @ q[bi, h].double() / math.sqrt(d), dim=0)
            torch.testing.assert_close(out[bi, h].double(), p @ vals, atol=1e-5, rtol=1e-5)
if sys.argv[1] == "AVX2":  # no bf16 path: the op says so instead of computing anything
    assert not torch.ops.llminfer_cpu.bf16_supported() and not build.bf16_kernel_available()
    try:
        bf16_linear(torch.zeros(1, 32).bfloat16(), torch.zeros(2, 32).bfloat16())
        raise AssertionError("bf16_linear ran on the AVX2 build")
    except RuntimeError as exc:
        assert "no AVX-512 BF16 path" in str(exc), exc
if build.int8_activation_bits() is None:  # no VNNI: no int4 path either
    try:
        int4_linear(torch.zeros(1, 32), torch.zeros(2, 64, dtype=torch.uint8), torch.ones(2, 1),
                                torch.zeros(2, 1), 32)
        raise AssertionError("int4_linear ran without VNNI")
    except RuntimeError as exc:
        assert "no AVX-512 VNNI path" in str(exc), exc
import llminfer.kernels.int8_group_linear as grp  # 6-bit codes: the int8 kernel's bits on the same codes
for n, k, m in [(40, 64, 1), (24, 96, 5)]:  # 40: a last block of half the lanes (AVX-512)
    codes = torch.randint(0, 64, (n, k), generator=g)
    s, z = grp.pack_group_q8_params(torch.rand(n, k // 32, generator=g)), grp.pack_group_q8_params(torch.randn(n, k // 32))
    x = torch.randn(m, k, generator=g)
    six = torch.ops.llminfer_cpu.int6_group_linear_q8(x, grp.pack_int6_group_q8(codes), s, z, n, None)
    assert torch.equal(six, torch.ops.llminfer_cpu.int8_group_linear_q8(x, grp.pack_int8_group_q8(codes.to(torch.uint8)), s, z, n, None))
print("other build ok")
"""


@pytest.mark.skipif(not build.AVX512_CPU_FLAGS <= build.cpu_flags(), reason="this CPU has no AVX-512")
def test_other_build_where_the_cpu_has_avx512():
    """On an AVX-512 CPU, the build this process did not load (AVX2 with ``LLMINFER_CPU_KERNEL_ISA=avx2``, or
    AVX-512 where this process was forced to AVX2), built and checked in a child process (one process cannot
    load both builds): products against float64, a row alone against the same row in a batch, and decode
    attention against a float64 reference, including rows that end in half a vector (AVX-512)."""
    import os
    import subprocess
    import sys

    other = "avx2" if build.target_isa() == "avx512" else "avx512"
    env = {**os.environ, build.ISA_ENV: other}
    name = "AVX-512" if other == "avx512" else "AVX2"
    done = subprocess.run([sys.executable, "-c", _OTHER_BUILD_CHECK, name], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "other build ok" in done.stdout, done.stderr[-2000:]


def test_ops_trace_under_torch_compile():
    """The ops (both linear products and the attention) have fake (shape-only) implementations, so
    ``torch.compile(fullgraph=True)`` captures them in one graph (without them dynamo cannot trace the op and fullgraph raises) and the graph computes
    what the eager call does."""
    assert build.skinny_linear_available(), build.unavailable_reason()
    torch.manual_seed(0)
    fp32 = SkinnyLinear(nn.Linear(64, 24))
    int8 = Int8WeightOnlyLinear(nn.Linear(64, 24))
    assert enable_cpu_kernels(nn.Sequential(int8)) == 1
    cache, tables, q, _, _ = _paged_step(4, 8, 2, 16, [3, 9], seed=5)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    ctx_lens = torch.tensor([3, 9])

    def step(x, q):
        attn = torch.ops.llminfer_cpu.paged_decode_attention(q, cache.k[0], cache.v[0], block_tables, ctx_lens, 0.25)
        return fp32(x) + int8(x), attn

    x = torch.randn(3, 64)
    q = q[0].transpose(0, 1).contiguous()  # [B, H, D]: one decode token per sequence
    torch._dynamo.reset()
    with torch.inference_mode():
        want = step(x, q)
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, q)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_compiled_backend_uses_the_kernels(model_dirs, monkeypatch):
    """``--backend compiled`` on CPU takes the kernels too (inside its one graph) and gives the eager tokens."""
    from llminfer.backends.compiled import COMPILE_BACKEND_ENV
    from llminfer.config import Backend

    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    with make_engine(model_dirs["qwen2"], max_batch_size=2) as engine:
        assert not isinstance(engine.runtime.model.get_output_embeddings(), SkinnyLinear)
        want = engine.run("compiled kernels", max_new_tokens=6, ignore_eos=True).token_ids
    with make_engine(model_dirs["qwen2"], max_batch_size=2, backend=Backend.COMPILED,
                     compile_fallback_to_eager=False) as engine:
        info = engine.info()
        assert info["attention_backend"] == "cpu" and info["cpu_kernel"].startswith("skinny_linear on ")
        assert any(isinstance(m, SkinnyLinear) for m in engine.runtime.model.modules())
        # the compiled graph's LM head takes the kernel (the eager backend's oneDNN-packed head does not trace)
        assert isinstance(engine.runtime.model.get_output_embeddings(), SkinnyLinear)
        assert engine.run("compiled kernels", max_new_tokens=6, ignore_eos=True).token_ids == want
        stats = engine.backend.stats()
        assert stats["compiled_steps"] > 0 and stats["eager_steps"] == 0


def test_a_dead_builds_lock_file_does_not_block_the_next_build(tmp_path):
    """torch's build lock is a plain file that a killed build leaves behind (every later process then
    waited for it forever); under llminfer's OS lock it is known stale and removed."""
    (tmp_path / "lock").touch()
    with build._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_process_waiting_for_anothers_build_says_so(tmp_path):
    """A second process blocks on the build lock while the first builds (minutes, the first time): it logs
    one warning saying why, instead of sitting silent."""
    import fcntl
    import threading

    import structlog

    entered = threading.Event()

    def wait_for_the_lock() -> None:
        with build._build_lock(tmp_path):
            entered.set()

    with open(tmp_path / "llminfer.lock", "w") as other:  # "another process" holds the OS lock
        fcntl.flock(other, fcntl.LOCK_EX)
        with structlog.testing.capture_logs() as logs:
            waiter = threading.Thread(target=wait_for_the_lock)
            waiter.start()
            waiter.join(0.5)  # bounded: it must still be waiting (the lock is held)
            assert not entered.is_set()
            fcntl.flock(other, fcntl.LOCK_UN)
            waiter.join(30)
    assert entered.is_set()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "waiting for another process that is building or loading llminfer's CPU kernels (a first build takes a "
        "few minutes)"]


def test_two_checkouts_of_the_same_source_build_in_two_folders(monkeypatch, tmp_path):
    first = build._cache_dir("avx2")
    for name in ("SOURCES", "HEADERS"):
        copies = [tmp_path / src.name for src in getattr(build, name)]
        for src, copy in zip(getattr(build, name), copies):
            copy.write_bytes(src.read_bytes())
        monkeypatch.setattr(build, name, tuple(copies))
    assert build._cache_dir("avx2") != first


def test_a_changed_header_changes_the_build_key(monkeypatch, tmp_path):
    """The build folder is keyed by every C++ file, the headers the op files include too (the sources alone
    would keep a stale build after an edit of ``common.h``)."""
    assert build.HEADERS and {h.name for h in build.HEADERS} >= {"common.h"}
    for name in ("SOURCES", "HEADERS"):
        copies = [tmp_path / src.name for src in getattr(build, name)]
        for src, copy in zip(getattr(build, name), copies):
            copy.write_bytes(src.read_bytes())
        monkeypatch.setattr(build, name, tuple(copies))
    before = build._cache_dir("avx2")
    header = tmp_path / "common.h"
    header.write_text(header.read_text() + "\n// edited\n")
    assert build._cache_dir("avx2") != before


def test_the_environments_own_ninja_builds_whatever_path_says(monkeypatch, tmp_path):
    """The ninja installed with llminfer builds the kernels whether or not its virtualenv is activated: with
    PATH's ninja (another version) in turn, each process took the other's build for a changed command and
    rebuilt everything. A different ninja, or another virtualenv's torch, gets a folder of its own."""
    import sysconfig

    own = Path(sysconfig.get_path("scripts")) / "ninja"
    if not own.is_file():
        pytest.skip("no ninja in this Python's environment")
    elsewhere = tmp_path / "bin"
    elsewhere.mkdir()
    (elsewhere / "ninja").write_text("#!/bin/sh\nexit 1\n")
    (elsewhere / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", str(elsewhere))
    assert build.ninja_program() == own
    with build._ninja_first_on_path():
        assert os.environ["PATH"].split(os.pathsep)[:2] == [str(own.parent), str(elsewhere)]
    assert os.environ["PATH"] == str(elsewhere)
    key = build._cache_dir("avx2")
    with monkeypatch.context() as patch:
        patch.setattr(build.torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
        assert build._cache_dir("avx2") != key
    assert build._cache_dir("avx2") == key
    monkeypatch.setattr(build, "ninja_program", lambda: elsewhere / "ninja")
    assert build._cache_dir("avx2") != key
