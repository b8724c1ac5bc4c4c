"""llminfer's CPU kernels (``llminfer.backends.cpu_kernels``): the skinny linear product and the paged
decode attention against float64 / torch references, their batch invariance, their argument checks, the
engine wiring (``engine.info()``, ``cpu_kernels=False``), and the fallback where the kernel cannot be built."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import make_engine
from llminfer.backends import cpu_kernels
from llminfer.backends.attention import PagedKVCache, build_metadata, paged_attention_forward
from llminfer.backends.weight_only import Int8WeightOnlyLinear

# Skipped only where the kernel cannot run at all (not x86-64, no AVX2/FMA, switched off); on a machine
# that can run it, a failed build fails test_kernel_builds_here and every test below.
pytestmark = pytest.mark.skipif(cpu_kernels._why_not_here() is not None,
                                reason=f"llminfer's CPU kernel cannot run here: {cpu_kernels._why_not_here()}")


@pytest.fixture(autouse=True)
def _kernel_loaded():
    """Every test may call the ops directly: load (and on first use build) the kernel first, whichever
    tests run and in whatever order."""
    cpu_kernels.skinny_linear_available()


def test_kernel_builds_here():
    assert cpu_kernels.skinny_linear_available(), cpu_kernels.unavailable_reason()


def _ref(x, w, scale=None, bias=None):
    w64 = w.double() * (scale.double()[:, None] if scale is not None else 1.0)
    out = x.double() @ w64.T
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 130])
@pytest.mark.parametrize("k", [8, 520])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_fp32_matches_float64(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    out = cpu_kernels.skinny_linear(x, w, None, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _ref(x, w, None, b), atol=1e-4 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 4, 6, 32])
def test_skinny_linear_int8_matches_dequantized(m):
    g = torch.Generator().manual_seed(m)
    n, k = 67, 136
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale, bias = torch.rand(n, generator=g) / 50, torch.randn(n, generator=g)
    out = cpu_kernels.skinny_linear(x, q, scale, bias)
    torch.testing.assert_close(out.double(), _ref(x, q, scale, bias), atol=1e-4, rtol=1e-5)


def _integer_path() -> bool:
    """Whether int8 products run on the VNNI build's integer path here."""
    assert cpu_kernels.skinny_linear_available(), cpu_kernels.unavailable_reason()
    return cpu_kernels.int8_activation_bits() == 14


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
    out = cpu_kernels.int8_linear(x, q, scale, b)
    if not (_integer_path() and k % 32 == 0):
        assert torch.equal(out, cpu_kernels.skinny_linear(x, q, scale, b))
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
    out = cpu_kernels.int8_linear(x, q, s, b)
    assert torch.isnan(out[1]).all() and torch.equal(out[2], b) and not torch.isfinite(out[3]).any()
    assert torch.equal(out[0], cpu_kernels.int8_linear(x[:1], q, s, b)[0])


def test_skinny_linear_rows_are_batch_invariant():
    """A row's result has the same bits alone, in any batch (decode-sized or prefill-sized, which run the
    tiles in different orders), at any place in a 4-row tile, with 1 or 2 threads, fp32 or int8 (both
    :func:`skinny_linear` and :func:`int8_linear`, whose VNNI path quantizes each row), with the scale and
    bias epilogue: the kernel's operations depend on nothing but K."""
    g = torch.Generator().manual_seed(0)
    w, w8, s = torch.randn(131, 512, generator=g), torch.randint(-127, 128, (131, 512), generator=g,
                                                                  dtype=torch.int8), torch.rand(131, generator=g)
    b = torch.randn(131, generator=g)
    row = torch.randn(1, 512, generator=g)
    sk, i8 = cpu_kernels.skinny_linear, cpu_kernels.int8_linear
    variants = [(sk, w, None, None), (sk, w, None, b), (sk, w8, s, None), (sk, w8, s, b), (i8, w8, s, None),
                (i8, w8, s, b)]
    alone = [fn(row, *v) for fn, *v in variants]
    threads = torch.get_num_threads()
    try:
        # 1-4 rows, up to 16 (int8 converted in registers), more (blocked, int8 converted once per block)
        for num_threads, m, at in ((1, 7, 5), (threads, 7, 3), (threads, 32, 31), (threads, 2, 0), (threads, 4, 2),
                                   (threads, 5, 4), (threads, 16, 13), (threads, 17, 16), (threads, 300, 150),
                                   (1, 300, 299)):
            torch.set_num_threads(num_threads)
            x = torch.randn(m, 512, generator=g)
            x[at] = row[0]
            for (fn, *v), ref in zip(variants, alone):
                assert torch.equal(fn(x, *v)[at], ref[0]), (m, at, fn, v[0].dtype, v[2] is None)
    finally:
        torch.set_num_threads(threads)


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
        cpu_kernels.skinny_linear(*args)


@pytest.mark.parametrize("args, match", [
    ((torch.randn(2, 64), torch.randn(3, 64), torch.rand(3)), "int8"),
    ((torch.randn(2, 64), torch.ones(3, 64, dtype=torch.int8), torch.rand(4)), "scale"),
    ((torch.randn(2, 64).double(), torch.ones(3, 64, dtype=torch.int8), torch.rand(3)), "float32"),
    ((torch.randn(2, 64), torch.ones(3, 32, dtype=torch.int8), torch.rand(3)), "K"),
    ((torch.randn(2, 64), torch.ones(3, 64, dtype=torch.int8), torch.rand(3), torch.rand(2)), "bias"),
])
def test_int8_linear_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        cpu_kernels.int8_linear(*args)


def test_skinny_linear_module_falls_back_outside_its_domain():
    torch.manual_seed(0)
    lin = nn.Linear(64, 24)
    mod = cpu_kernels.SkinnyLinear(lin)
    assert mod.weight is lin.weight and mod.bias is lin.bias
    with torch.inference_mode():
        for x in (torch.randn(3, 5, 64), torch.randn(1000, 64)):  # decode- and prefill-sized: the kernel
            out = mod(x)
            assert torch.equal(out, cpu_kernels.skinny_linear(x.reshape(-1, 64), lin.weight, None, lin.bias)
                               .reshape(out.shape))
            torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        x = torch.randn(2, 64).double()  # another dtype: F.linear, which refuses the mix like nn.Linear
        with pytest.raises(RuntimeError):
            mod(x)
    x = torch.randn(2, 64, requires_grad=True)
    mod(x).sum().backward()  # gradients take F.linear
    assert x.grad is not None


def _paged_step(block_size, heads, kv_heads, head_dim, ctx_lens, seed, num_blocks=64):
    """A one-layer cache with random history and shuffled block tables; pure decode at ``ctx_lens``."""
    assert cpu_kernels.skinny_linear_available(), cpu_kernels.unavailable_reason()  # loads the ops
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim, torch.float32, "cpu")
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    perm = list(range(num_blocks))
    random.Random(seed).shuffle(perm)
    tables, used = [], 0
    for n in ctx_lens:
        need = -(-n // block_size)
        tables.append(perm[used:used + need])
        used += need
    t = len(ctx_lens)
    q = torch.randn(1, t, heads, head_dim, generator=g).transpose(1, 2)
    k = torch.randn(1, t, kv_heads, head_dim, generator=g).transpose(1, 2)
    v = torch.randn(1, t, kv_heads, head_dim, generator=g).transpose(1, 2)
    return cache, tables, q, k, v


class _Layer:
    layer_idx = 0


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [16, 24, 64])
def test_paged_decode_attention_matches_torch_path(heads, kv_heads, block_size, head_dim):
    """The kernel (``attention_backend="cpu"``) against the gather + masked-attention path on the same
    step: contexts of 1 token, within a block, on block edges and across many blocks; the KV write is the
    same code on both. A head_dim of 24 ends in half an AVX-512 vector."""
    ctx = [1, 3, block_size, block_size + 1, 77, 200]
    cache, tables, q, k, v = _paged_step(block_size, heads, kv_heads, head_dim, ctx, seed=block_size + heads)
    k0, v0 = cache.k[0].clone(), cache.v[0].clone()
    starts, lengths = [n - 1 for n in ctx], [1] * len(ctx)
    meta, _ = build_metadata(cache, starts, lengths, tables, "cpu", attention_backend="torch")
    ref, _ = paged_attention_forward(_Layer(), q, k, v, None, scaling=0.25, llminfer_attn=meta)
    cache.k[0].copy_(k0)
    cache.v[0].copy_(v0)
    meta, _ = build_metadata(cache, starts, lengths, tables, "cpu", attention_backend="cpu")
    assert meta.decode is not None and meta.decode.ctx_lens is not None
    out, _ = paged_attention_forward(_Layer(), q, k, v, None, scaling=0.25, llminfer_attn=meta)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 24, 64])
def test_paged_decode_attention_reads_a_bf16_cache_in_place(head_dim):
    """A bf16 step (bf16 query, K/V cache in bf16): the kernel widens K/V exactly and computes in float32,
    so against a float64 reference on the same bf16 values its error is the output's one bf16 rounding;
    the torch path (bf16 gather and bf16 attention) is only close to it."""
    ctx = [1, 5, 16, 17, 77]
    cache, tables, q, k, v = _paged_step(16, 8, 2, head_dim, ctx, seed=head_dim)
    cache.k[0] = cache.k[0].bfloat16()
    cache.v[0] = cache.v[0].bfloat16()
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    starts, lengths = [n - 1 for n in ctx], [1] * len(ctx)
    k0, v0 = cache.k[0].clone(), cache.v[0].clone()
    meta, _ = build_metadata(cache, starts, lengths, tables, "cpu", attention_backend="torch")
    torch_path, _ = paged_attention_forward(_Layer(), q, k, v, None, scaling=0.25, llminfer_attn=meta)
    cache.k[0].copy_(k0)
    cache.v[0].copy_(v0)
    meta, _ = build_metadata(cache, starts, lengths, tables, "cpu", attention_backend="cpu")
    out, _ = paged_attention_forward(_Layer(), q, k, v, None, scaling=0.25, llminfer_attn=meta)
    assert out.dtype == torch.bfloat16
    for i, n in enumerate(ctx):  # the reference over the cache as written by the step (new token included)
        slots = [(tables[i][t // 16], t % 16) for t in range(n)]
        for h in range(8):
            keys = torch.stack([cache.k[0][h // 4, blk, off] for blk, off in slots]).double()
            vals = torch.stack([cache.v[0][h // 4, blk, off] for blk, off in slots]).double()
            p = torch.softmax(keys @ q[0, h, i].double() * 0.25, dim=0)
            want = p @ vals
            assert ((out[0, i, h].double() - want).abs() <= 2.0**-8 * want.abs() + 1e-5).all()
    torch.testing.assert_close(out.float(), torch_path.float(), atol=5e-2, rtol=5e-2)


def test_paged_decode_attention_next_to_prefill_chunks():
    """Decode rows on the kernel and prefill chunks on the torch path in one step."""
    bs, heads, kv_heads, d = 4, 8, 2, 16
    starts, lengths = [9, 0, 30, 5], [1, 6, 1, 3]
    cache, tables, q, k, v = _paged_step(bs, heads, kv_heads, d, [s + n for s, n in zip(starts, lengths)], seed=5)
    tables = [t for t in tables]
    k0, v0 = cache.k[0].clone(), cache.v[0].clone()
    q = torch.randn(1, sum(lengths), heads, d).transpose(1, 2)
    k = torch.randn(1, sum(lengths), kv_heads, d).transpose(1, 2)
    v = torch.randn(1, sum(lengths), kv_heads, d).transpose(1, 2)
    outs = []
    for backend in ("torch", "cpu"):
        cache.k[0].copy_(k0)
        cache.v[0].copy_(v0)
        meta, _ = build_metadata(cache, starts, lengths, tables, "cpu", attention_backend=backend)
        outs.append(paged_attention_forward(_Layer(), q, k, v, None, scaling=None, llminfer_attn=meta)[0])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_paged_decode_attention_is_batch_invariant():
    """One sequence's output has the same bits alone and in a batch, whatever its row and the table width."""
    bs, heads, kv_heads, d = 16, 8, 2, 64
    cache, tables, q, _, _ = _paged_step(bs, heads, kv_heads, d, [300, 5, 129, 40, 1], seed=9)
    lens = torch.tensor([300, 5, 129, 40, 1])
    width = max(map(len, tables)) + 3
    table = torch.zeros(5, width, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    qd = q[0].transpose(0, 1)  # [B, H, D], strided like the engine's
    op = torch.ops.llminfer_cpu.paged_decode_attention
    batch = op(qd, cache.k[0], cache.v[0], table, lens, 0.125)
    for i in range(5):
        alone = op(qd[i : i + 1], cache.k[0], cache.v[0], table[i : i + 1, : len(tables[i])].contiguous(),
                   lens[i : i + 1], 0.125)
        assert torch.equal(alone[0], batch[i])


def test_paged_decode_attention_rejects_bad_tables():
    bs, heads, kv_heads, d = 4, 4, 2, 8
    cache, _, q, _, _ = _paged_step(bs, heads, kv_heads, d, [5], seed=1, num_blocks=8)
    op = torch.ops.llminfer_cpu.paged_decode_attention
    qd = q[0].transpose(0, 1)
    with pytest.raises(RuntimeError, match="block id"):
        op(qd, cache.k[0], cache.v[0], torch.tensor([[0, 8]]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        op(qd, cache.k[0], cache.v[0], torch.tensor([[0, 1]]), torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        op(qd, cache.k[0], cache.v[0], torch.tensor([[0, 1]]), torch.tensor([0]), 1.0)


def test_int8_weight_only_layer_uses_the_kernel_at_any_row_count():
    torch.manual_seed(0)
    lin = nn.Linear(64, 40)
    layer = Int8WeightOnlyLinear(lin)
    assert cpu_kernels.enable_cpu_kernels(nn.Sequential(layer)) == 1 and layer.use_cpu_kernel
    want = lambda x: F.linear(x.double(), layer.dequantized_weight().double(), lin.bias.double())  # noqa: E731
    with torch.inference_mode():
        small = torch.randn(2, 3, 64)  # 6 rows: the kernel (float32 or, on VNNI, 14-bit activations)
        flat = small.reshape(6, 64)
        q8 = layer.kernel_path == "q8"  # the path quant_paths chose: 8-bit block activations (test_cpu_kernels_q8)
        product = cpu_kernels.int8_linear_q8 if q8 else cpu_kernels.int8_linear
        assert torch.equal(layer(small).reshape(6, 40), product(flat, layer.weight, layer.scales.float(), lin.bias.detach()))
        atol, rtol = (5e-2, 2e-2) if q8 else (1e-4 if not _integer_path() else 1e-3, 1e-5)
        torch.testing.assert_close(layer(small).double(), want(small), atol=atol, rtol=rtol)
        big = torch.randn(300, 64)
        torch.testing.assert_close(layer(big).double(), want(big), atol=atol, rtol=rtol)
        layer.use_cpu_kernel = False  # torch's kernel: bf16 activations, so only close
        torch.testing.assert_close(layer(big).double(), want(big), atol=5e-2, rtol=2e-2)


def test_engine_reports_and_honours_the_switch(model_dirs):
    with make_engine(model_dirs["qwen2"], max_batch_size=2) as engine:
        info = engine.info()
        assert info["attention_backend"] == "cpu"
        assert info["cpu_kernel"].startswith("skinny_linear on ") and engine.runtime.cpu_kernel_layers > 0
        assert f"({cpu_kernels.vector_isa()}, " in info["cpu_kernel"]
        on = engine.run("kernels on", max_new_tokens=6, ignore_eos=True).token_ids
    with make_engine(model_dirs["qwen2"], max_batch_size=2, cpu_kernels=False) as engine:
        info = engine.info()
        assert info["attention_backend"] == "torch" and info["cpu_kernel"] == "off (cpu_kernels=False)"
        assert not any(isinstance(m, cpu_kernels.SkinnyLinear) for m in engine.runtime.model.modules())
        assert engine.run("kernels on", max_new_tokens=6, ignore_eos=True).token_ids == on


def test_unbuildable_kernel_falls_back_to_torch(model_dirs, monkeypatch):
    """No compiler (the build raises): one warning, 0 layers swapped, torch attention, same tokens."""
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'llminfer_cpu_kernels'\nc++: not found")

    with make_engine(model_dirs["qwen2"], max_batch_size=2) as engine:
        want = engine.run("fallback", max_new_tokens=6, ignore_eos=True).token_ids
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    cpu_kernels._reset_for_tests()
    try:
        assert not cpu_kernels.skinny_linear_available()
        assert "c++: not found" in cpu_kernels.unavailable_reason()
        with make_engine(model_dirs["qwen2"], max_batch_size=2) as engine:
            info = engine.info()
            assert info["attention_backend"] == "torch" and info["cpu_kernel"].startswith("off (build failed")
            assert engine.run("fallback", max_new_tokens=6, ignore_eos=True).token_ids == want
    finally:
        monkeypatch.undo()
        cpu_kernels._reset_for_tests()
        assert cpu_kernels.skinny_linear_available()


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    cpu_kernels._reset_for_tests()
    try:
        assert not cpu_kernels.skinny_linear_available()
        assert cpu_kernels.unavailable_reason() == f"{cpu_kernels.DISABLE_ENV}=0"
    finally:
        monkeypatch.undo()
        cpu_kernels._reset_for_tests()


def test_build_folder_follows_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMINFER_CACHE_DIR", str(tmp_path))
    assert cpu_kernels._cache_dir().parent == tmp_path / "cpu_kernels"


def test_build_isa_follows_the_switch_and_the_cpu_flags(monkeypatch):
    """AVX-512 where the CPU has all four of F/BW/DQ/VL (the build then passes their -m flags), else AVX2;
    ``LLMINFER_CPU_KERNEL_ISA=avx2`` forces AVX2; the two builds live in different folders."""
    partial = {"avx2", "fma", "avx512f"}  # F alone (no BW/DQ/VL) is not enough
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: partial | cpu_kernels.AVX512_CPU_FLAGS)
    assert cpu_kernels.target_isa() == cpu_kernels.best_isa() == "avx512"
    for value, want in (("avx2", "avx2"), (" AVX2 ", "avx2"), ("avx512", "avx512"), ("auto", "avx512")):
        monkeypatch.setenv(cpu_kernels.ISA_ENV, value)
        assert cpu_kernels.target_isa() == want, value
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: partial)
    for value in ("avx512", "auto", "avx2"):
        monkeypatch.setenv(cpu_kernels.ISA_ENV, value)
        assert cpu_kernels.target_isa() == "avx2", value
    monkeypatch.delenv(cpu_kernels.ISA_ENV)
    assert cpu_kernels.target_isa() == cpu_kernels.best_isa() == "avx2"
    assert "-mavx512f" in cpu_kernels.build_cflags("avx512") and "-mavx512f" not in cpu_kernels.build_cflags("avx2")
    assert cpu_kernels._cache_dir("avx512") != cpu_kernels._cache_dir("avx2")


def test_vnni_joins_the_avx512_build_where_the_cpu_has_it(monkeypatch):
    """``-mavx512vnni`` (int8 on integer dot products) only in the AVX-512 build, only where the CPU has
    ``avx512_vnni``, and not with ``LLMINFER_CPU_KERNEL_VNNI=0``; each choice builds in its own folder."""
    base = {"avx2", "fma"} | cpu_kernels.AVX512_CPU_FLAGS
    monkeypatch.delenv(cpu_kernels.VNNI_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: base | {"avx512_vnni"})
    with_vnni = cpu_kernels._cache_dir("avx512")
    assert "-mavx512vnni" in cpu_kernels.build_cflags("avx512") and "-mavx512vnni" not in cpu_kernels.build_cflags("avx2")
    monkeypatch.setenv(cpu_kernels.VNNI_ENV, "0")
    assert "-mavx512vnni" not in cpu_kernels.build_cflags("avx512") and cpu_kernels._cache_dir("avx512") != with_vnni
    monkeypatch.delenv(cpu_kernels.VNNI_ENV)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: base)
    assert "-mavx512vnni" not in cpu_kernels.build_cflags("avx512")


def test_bf16_joins_the_avx512_build_where_the_cpu_has_it(monkeypatch):
    """``-mavx512bf16`` (bf16 products on vdpbf16ps) only in the AVX-512 build and only where the CPU has
    ``avx512_bf16``; each choice builds in its own folder."""
    base = {"avx2", "fma"} | cpu_kernels.AVX512_CPU_FLAGS
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: base | {"avx512_bf16"})
    with_bf16 = cpu_kernels._cache_dir("avx512")
    assert "-mavx512bf16" in cpu_kernels.build_cflags("avx512") and "-mavx512bf16" not in cpu_kernels.build_cflags("avx2")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: base)
    assert "-mavx512bf16" not in cpu_kernels.build_cflags("avx512") and cpu_kernels._cache_dir("avx512") != with_bf16


def test_loaded_build_matches_the_switch():
    assert cpu_kernels.skinny_linear_available(), cpu_kernels.unavailable_reason()
    want = "AVX-512" if cpu_kernels.target_isa() == "avx512" else "AVX2"
    assert cpu_kernels.vector_isa() == want


_OTHER_BUILD_CHECK = """
import math, sys, torch
from llminfer.backends import cpu_kernels
assert cpu_kernels.skinny_linear_available(), cpu_kernels.unavailable_reason()
assert cpu_kernels.vector_isa() == sys.argv[1], cpu_kernels.vector_isa()
g = torch.Generator().manual_seed(0)
for m, n, k in [(1, 7, 520), (5, 130, 64), (33, 4, 8), (4, 13, 24)]:  # K % 16 == 8 ends in half a vector
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    q, s = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g)
    ref = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(cpu_kernels.skinny_linear(x, w, None, b).double(), ref, atol=1e-4 * k**0.5, rtol=1e-5)
    ref = x.double() @ (q.double() * s.double()[:, None]).T
    torch.testing.assert_close(cpu_kernels.skinny_linear(x, q, s).double(), ref, atol=1e-4 * k**0.5, rtol=1e-5)
    assert torch.equal(cpu_kernels.skinny_linear(x, w)[m - 1], cpu_kernels.skinny_linear(x[m - 1:], w)[0])
    assert torch.equal(cpu_kernels.skinny_linear(x, q, s, b)[m - 1], cpu_kernels.skinny_linear(x[m - 1:], q, s, b)[0])
    assert torch.equal(cpu_kernels.int8_linear(x, q, s, b)[m - 1], cpu_kernels.int8_linear(x[m - 1:], q, s, b)[0])
    if cpu_kernels.int8_activation_bits() is None:  # no integer path in this build: int8_linear is skinny_linear
        assert torch.equal(cpu_kernels.int8_linear(x, q, s, b), cpu_kernels.skinny_linear(x, q, s, b))
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
    assert not torch.ops.llminfer_cpu.bf16_supported() and not cpu_kernels.bf16_kernel_available()
    try:
        cpu_kernels.bf16_linear(torch.zeros(1, 32).bfloat16(), torch.zeros(2, 32).bfloat16())
        raise AssertionError("bf16_linear ran on the AVX2 build")
    except RuntimeError as exc:
        assert "no AVX-512 BF16 path" in str(exc), exc
if cpu_kernels.int8_activation_bits() is None:  # no VNNI: no int4 path either
    try:
        cpu_kernels.int4_linear(torch.zeros(1, 32), torch.zeros(2, 64, dtype=torch.uint8), torch.ones(2, 1),
                                torch.zeros(2, 1), 32)
        raise AssertionError("int4_linear ran without VNNI")
    except RuntimeError as exc:
        assert "no AVX-512 VNNI path" in str(exc), exc
print("other build ok")
"""


@pytest.mark.skipif(not cpu_kernels.AVX512_CPU_FLAGS <= cpu_kernels.cpu_flags(), reason="this CPU has no AVX-512")
def test_other_build_where_the_cpu_has_avx512():
    """On an AVX-512 CPU, the build this process did not load (AVX2 with ``LLMINFER_CPU_KERNEL_ISA=avx2``, or
    AVX-512 where this process was forced to AVX2), built and checked in a child process (one process cannot
    load both builds): products against float64, a row alone against the same row in a batch, and decode
    attention against a float64 reference, including rows that end in half a vector (AVX-512)."""
    import os
    import subprocess
    import sys

    other = "avx2" if cpu_kernels.target_isa() == "avx512" else "avx512"
    env = {**os.environ, cpu_kernels.ISA_ENV: other}
    name = "AVX-512" if other == "avx512" else "AVX2"
    done = subprocess.run([sys.executable, "-c", _OTHER_BUILD_CHECK, name], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "other build ok" in done.stdout, done.stderr[-2000:]


def test_ops_trace_under_torch_compile():
    """The ops (both linear products and the attention) have fake (shape-only) implementations, so
    ``torch.compile(fullgraph=True)`` captures them in one graph (without them dynamo cannot trace the op and fullgraph raises) and the graph computes
    what the eager call does."""
    assert cpu_kernels.skinny_linear_available(), cpu_kernels.unavailable_reason()
    torch.manual_seed(0)
    fp32 = cpu_kernels.SkinnyLinear(nn.Linear(64, 24))
    int8 = Int8WeightOnlyLinear(nn.Linear(64, 24))
    assert cpu_kernels.enable_cpu_kernels(nn.Sequential(int8)) == 1
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
        assert not isinstance(engine.runtime.model.get_output_embeddings(), cpu_kernels.SkinnyLinear)
        want = engine.run("compiled kernels", max_new_tokens=6, ignore_eos=True).token_ids
    with make_engine(model_dirs["qwen2"], max_batch_size=2, backend=Backend.COMPILED,
                     compile_fallback_to_eager=False) as engine:
        info = engine.info()
        assert info["attention_backend"] == "cpu" and info["cpu_kernel"].startswith("skinny_linear on ")
        assert any(isinstance(m, cpu_kernels.SkinnyLinear) for m in engine.runtime.model.modules())
        # the compiled graph's LM head takes the kernel (the eager backend's oneDNN-packed head does not trace)
        assert isinstance(engine.runtime.model.get_output_embeddings(), cpu_kernels.SkinnyLinear)
        assert engine.run("compiled kernels", max_new_tokens=6, ignore_eos=True).token_ids == want
        stats = engine.backend.stats()
        assert stats["compiled_steps"] > 0 and stats["eager_steps"] == 0


# ------------------------------------------------------------------------------------------ bf16 (vdpbf16ps)
def _bf16_path() -> bool:
    assert cpu_kernels.skinny_linear_available(), cpu_kernels.unavailable_reason()
    return cpu_kernels.bf16_kernel_available()


needs_bf16 = pytest.mark.skipif("avx512_bf16" not in cpu_kernels.cpu_flags() or cpu_kernels.target_isa() != "avx512",
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
    out = cpu_kernels.bf16_linear(x, w, b)
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
    alone = [cpu_kernels.bf16_linear(row, w, bias) for bias in (None, b)]
    assert torch.equal(cpu_kernels.bf16_linear(row, w, b.float()), alone[1])  # a bf16 bias is widened exactly
    threads = torch.get_num_threads()
    try:
        for num_threads, m, at in ((1, 7, 5), (threads, 2, 0), (threads, 4, 3), (threads, 5, 4), (threads, 33, 17),
                                   (threads, 300, 150), (1, 300, 299)):
            torch.set_num_threads(num_threads)
            x = torch.randn(m, 512, generator=g).bfloat16()
            x[at] = row[0]
            for bias, ref in zip((None, b), alone):
                assert torch.equal(cpu_kernels.bf16_linear(x, w, bias)[at], ref[0]), (m, at, bias is None)
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
        cpu_kernels.bf16_linear(*args)


@needs_bf16
def test_bf16_skinny_linear_takes_the_kernel_up_to_its_row_limit():
    """A bf16 ``SkinnyLinear``: up to BF16_KERNEL_MAX_ROWS rows exactly :func:`bf16_linear`, beyond exactly
    ``F.linear``; ``enable_cpu_kernels`` swaps bf16 layers (K % 32 == 0) only where the path runs and
    ``LLMINFER_CPU_KERNEL_BF16`` is not 0."""
    assert _bf16_path()
    torch.manual_seed(0)
    lin = nn.Linear(64, 24).bfloat16()
    model = nn.Sequential(lin, nn.Linear(48, 8).bfloat16())  # 48 % 32 != 0: stays
    assert cpu_kernels.enable_cpu_kernels(model) == 1
    mod = model[0]
    assert isinstance(mod, cpu_kernels.SkinnyLinear) and type(model[1]) is nn.Linear and mod.weight is lin.weight
    limit = cpu_kernels.BF16_KERNEL_MAX_ROWS
    with torch.inference_mode():
        small = torch.randn(1, limit, 64).bfloat16()
        assert torch.equal(mod(small)[0], cpu_kernels.bf16_linear(small[0], lin.weight, lin.bias))
        big = torch.randn(limit + 1, 64).bfloat16()
        assert torch.equal(mod(big), F.linear(big, lin.weight, lin.bias))
    import os
    os.environ[cpu_kernels.BF16_ENV] = "0"
    try:
        assert not cpu_kernels.bf16_kernel_available()
        assert cpu_kernels.enable_cpu_kernels(nn.Sequential(nn.Linear(64, 8).bfloat16())) == 0
    finally:
        del os.environ[cpu_kernels.BF16_ENV]


@needs_bf16
def test_bf16_engine_runs_its_layers_and_small_head_steps_on_the_kernel(model_dirs, monkeypatch):
    """A bf16 engine (eager): every linear layer is a bf16 ``SkinnyLinear``, the oneDNN-packed head takes
    the kernel for small steps, ``info`` says so; with ``cpu_kernels=False`` or ``LLMINFER_CPU_KERNEL_BF16=0``
    none of that, and the greedy tokens of the first steps agree (bf16 rounding may part them later)."""
    from llminfer.backends.prepack import PrepackedLinear

    assert _bf16_path()
    with make_engine(model_dirs["qwen2"], max_batch_size=2, dtype="bfloat16") as engine:
        model = engine.runtime.model
        swapped = [m for m in model.modules() if isinstance(m, cpu_kernels.SkinnyLinear)]
        assert swapped and all(m.weight.dtype == torch.bfloat16 for m in swapped)
        assert len(swapped) == engine.runtime.cpu_kernel_layers
        head = model.get_output_embeddings()
        assert isinstance(head, PrepackedLinear) and head.bf16_kernel_rows == cpu_kernels.BF16_KERNEL_MAX_ROWS
        line = engine.info()["cpu_kernel"]
        assert line.startswith("bf16_linear on ") and "bf16 on AVX-512 BF16 up to" in line, line
        assert engine.info()["attention_backend"] == "cpu"  # decode attention reads the bf16 cache in place
        on = engine.run("bf16 kernel", max_new_tokens=3, ignore_eos=True).token_ids
    for kw in ({"cpu_kernels": False}, {}):
        if not kw:
            monkeypatch.setenv(cpu_kernels.BF16_ENV, "0")
        with make_engine(model_dirs["qwen2"], max_batch_size=2, dtype="bfloat16", **kw) as engine:
            model = engine.runtime.model
            assert not any(isinstance(m, cpu_kernels.SkinnyLinear) for m in model.modules())
            assert getattr(model.get_output_embeddings(), "bf16_kernel_rows", 0) == 0
            assert engine.run("bf16 kernel", max_new_tokens=3, ignore_eos=True).token_ids[:1] == on[:1]


# ---------------------------------------------------------------------------------------- int4 (VNNI)
def _int4_case(n, k, group, seed):
    from llminfer.backends.weight_only import pack_int4_codes

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = torch.rand(n, k // group, generator=g) / 20
    zero = torch.randn(n, k // group, generator=g) / 10
    return q, pack_int4_codes(q), scale, zero


def _int4_dense(q, scale, zero, group):
    return q.double() * scale.double().repeat_interleave(group, 1) + zero.double().repeat_interleave(group, 1)


needs_int_path = pytest.mark.skipif(cpu_kernels.target_isa() != "avx512" or not cpu_kernels.vnni_wanted(),
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
    out = cpu_kernels.int4_linear(x, codes, scale, zero, group, b)
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
    alone = cpu_kernels.int4_linear(row, codes, scale, zero, 32, b)
    threads = torch.get_num_threads()
    try:
        for num_threads, m, at in ((1, 7, 5), (threads, 8, 7), (threads, 9, 8), (threads, 33, 17), (threads, 300, 150),
                                   (1, 300, 299)):
            torch.set_num_threads(num_threads)
            x = torch.randn(m, 512, generator=g)
            x[at] = row[0]
            x[(at + 1) % m, 3] = float("nan")
            out = cpu_kernels.int4_linear(x, codes, scale, zero, 32, b)
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
        cpu_kernels.int4_linear(*args)


@pytest.mark.parametrize("n, k", [(5, 32), (3, 96), (17, 512), (2, 640)])
def test_int4_codes_round_trip(n, k):
    from llminfer.backends.weight_only import pack_int4_codes, unpack_int4_codes

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
    from llminfer.backends.weight_only import Int4WeightOnlyLinear, dequantize_int4, quantize_int4_groupwise

    torch.manual_seed(group)
    lin = nn.Linear(512, 37)
    layer = Int4WeightOnlyLinear(lin, group)
    q, sz = quantize_int4_groupwise(lin.weight, group)
    assert torch.equal(layer.codes(), q)
    x = torch.randn(2, 20, 512)
    with torch.inference_mode():
        before = layer(x)
        assert cpu_kernels.enable_cpu_kernels(nn.Sequential(layer)) == 1 and layer.use_cpu_kernel
        assert torch.equal(layer.codes(), q) and layer.weight.shape == (37, 256)
        after = layer(x)
        want = F.linear(x.double(), dequantize_int4(q, sz.bfloat16().float(), group).double(), lin.bias.double())
        torch.testing.assert_close(layer.dequantized_weight().double(),
                                   dequantize_int4(q, sz.bfloat16().float(), group).double(), atol=1e-6, rtol=1e-6)
        assert "scales_and_zeros" not in layer.state_dict()  # the kernel's scales replace torch's
    err_after, err_before = (after.double() - want).abs().max(), (before.double() - want).abs().max()
    if layer.kernel_path == "q8":  # 8-bit block activations: within their rounding bound (test_cpu_kernels_q8)
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
    from llminfer.backends.weight_only import Int4WeightOnlyLinear

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


@pytest.mark.parametrize("call", [
    lambda: cpu_kernels.skinny_linear(torch.randn(2, 0), torch.randn(3, 0)),
    lambda: cpu_kernels.int8_linear(torch.randn(2, 0), torch.zeros(3, 0, dtype=torch.int8), torch.rand(3)),
])
def test_empty_k_is_an_error_not_a_crash(call):
    """K = 0 once divided the work grain by zero (SIGFPE, the process gone): now a RuntimeError."""
    with pytest.raises(RuntimeError, match="K must be a positive multiple"):
        call()


@needs_bf16
def test_bf16_empty_k_is_an_error():
    assert _bf16_path()
    with pytest.raises(RuntimeError, match="K must be a positive multiple"):
        cpu_kernels.bf16_linear(torch.randn(2, 0).bfloat16(), torch.randn(5, 0).bfloat16())


@needs_int_path
def test_int4_empty_k_and_a_2d_bias_are_errors():
    assert _integer_path()
    with pytest.raises(RuntimeError, match="divide K"):
        cpu_kernels.int4_linear(torch.randn(2, 0), torch.zeros(4, 0, dtype=torch.uint8), torch.zeros(4, 0),
                                torch.zeros(4, 0), 32)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.int4_linear(torch.randn(2, 64), torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 2),
                                torch.zeros(4, 2), 32, torch.zeros(4, 1))


@needs_bf16
def test_bf16_engine_with_a_head_the_kernel_cannot_take(tmp_path):
    """hidden_size 48 (not a multiple of 32): the bf16 layers and LM head stay on torch (the packed head's
    small steps included), and requests run."""
    from llminfer.backends.prepack import PrepackedLinear
    from llminfer.models import build_random_model

    assert _bf16_path()
    build_random_model(tmp_path / "m", hidden_size=48, intermediate_size=128, num_heads=4, num_kv_heads=2,
                       num_layers=2)
    with make_engine(tmp_path / "m", max_batch_size=2, dtype="bfloat16") as engine:
        head = engine.runtime.model.get_output_embeddings()
        assert isinstance(head, PrepackedLinear) and head.bf16_kernel_rows == 0
        assert len(engine.run("Hello there", max_new_tokens=5, ignore_eos=True).token_ids) == 5


def test_a_dead_builds_lock_file_does_not_block_the_next_build(tmp_path):
    """torch's build lock is a plain file that a killed build leaves behind (every later process then
    waited for it forever); under llminfer's OS lock it is known stale and removed."""
    (tmp_path / "lock").touch()
    with cpu_kernels._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_two_checkouts_of_the_same_source_build_in_two_folders(monkeypatch, tmp_path):
    first = cpu_kernels._cache_dir("avx2")
    copies = [tmp_path / src.name for src in cpu_kernels.SOURCES]
    for src, copy in zip(cpu_kernels.SOURCES, copies):
        copy.write_bytes(src.read_bytes())
    monkeypatch.setattr(cpu_kernels, "SOURCES", tuple(copies))
    assert cpu_kernels._cache_dir("avx2") != first
