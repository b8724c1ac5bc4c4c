"""llminfer's CPU kernels against torch's, side by side in one run, on the bench model's shapes.

Products (``llminfer.kernels.linear.skinny_linear``), at 1, 4, 8, 32 and 64 activation rows:

* ``layers_fp32``: the 56 fp32 linear layers of the bench model's 8 decoder layers (q/k/v/o 512x512,
  128x512 twice, 512x512; gate/up 1536x512; down 512x1536), ``F.linear`` against the kernel;
* ``layers_int8``: the same layers in int8 weight-only, ``aten._weight_int8pack_mm`` (bf16 activations,
  the path torch vectorizes) against the kernel's ``int8_linear`` (what int8-wo layers run: fp32
  activations, or 14-bit integer ones on the AVX-512 VNNI build);
* ``head_fp32``: the 151,646 x 512 LM head, oneDNN's prepacked matmul (what the engine uses for it) against
  the kernel; ``head_int8``: the int8 head, torch's kernel against ours;
* ``layers_bf16`` / ``head_bf16`` (where the kernel has its AVX-512 BF16 path): ``F.linear`` in bf16 (and
  oneDNN's prepacked bf16 matmul for the head) against ``bf16_linear`` (the engine takes it up to 4 rows);
* ``layers_int4`` / ``head_int4`` (on the VNNI build): ``aten._weight_int4pack_mm_for_cpu`` (bf16
  activations, groups of 32) against ``int4_linear``;
* ``layers_int8_q8`` / ``head_int8_q8`` / ``layers_int4_q8`` / ``head_int4_q8``: the same torch kernels
  against the q8 path (``int8_linear_q8`` / ``int4_linear_q8``: 8-bit activations per 32 columns, u8 x s8
  dot products), every build. A closing table puts each q8 case next to its wide one (``wide/q8``, both
  timed in this run) and says which path ``quant_paths`` chose here.

Decode attention at batch 1 and 32 over 128- and 512-token contexts (8 query heads, 2 K/V heads, head
dim 64, 16-token blocks): the torch path (``attention_backend="torch"``: gather the blocks, masked
attention) against ``torch.ops.llminfer_cpu.paged_decode_attention``, which reads the blocks in place.

Each figure is the best of ``--reps`` timed loops (ms per call over all layers); kernel and torch
alternate in one process, so only their ratios are meant to be compared across machines.

The kernel is the build this CPU gets by default (printed first: AVX-512 where the CPU has AVX-512
F/BW/DQ/VL, else AVX2); ``LLMINFER_CPU_KERNEL_ISA=avx2`` runs the AVX2 build instead (saved as
``cpu_kernels_avx2``), so on an AVX-512 CPU the two builds compare through their ratios to the same torch
kernels. On a CPU with AVX-512 VNNI, ``LLMINFER_CPU_KERNEL_VNNI=0`` builds without it, so the int8
cases compare the integer path against float32 activations the same way.

    python bench/bench_cpu_kernels.py [--quick] [--reps 3]
    LLMINFER_CPU_KERNEL_ISA=avx2 python bench/bench_cpu_kernels.py [--quick]
    LLMINFER_CPU_KERNEL_VNNI=0 python bench/bench_cpu_kernels.py [--quick]   (saved as cpu_kernels_novnni)
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from common import environment, save
from llminfer.backends.attention import PagedKVCache, build_metadata, paged_attention_forward
from llminfer.benchmark.environment import StealMeter
from llminfer.kernels import build, path_choice
from llminfer.kernels.bf16_linear import bf16_linear
from llminfer.kernels.int4_linear import int4_linear
from llminfer.kernels.linear import int8_linear, skinny_linear
from llminfer.kernels.q8_linear import int4_linear_q8, int8_linear_q8

LAYER_SHAPES = [(512, 512), (128, 512), (128, 512), (512, 512), (1536, 512), (1536, 512), (512, 1536)]
VOCAB, HIDDEN, LAYERS = 151_646, 512, 8


def best_ms(fn: Callable[[], Any], loops: int, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - start) / loops)
    return best * 1e3


class _Layer:
    layer_idx = 0


def _product_cases(x, layers, layers8, head, packed, head8, head_scale) -> dict[str, tuple[Callable, Callable]]:
    """(torch, kernel) callables per case for the activations ``x`` (``{in_features: [rows, in_features]}``)."""
    sk, i8, int8pack = skinny_linear, int8_linear, torch.ops.aten._weight_int8pack_mm
    q8 = int8_linear_q8
    xb = {k: v.bfloat16() for k, v in x.items()}
    scales_bf16 = [[s.bfloat16() for _, s in layer] for layer in layers8]
    head_scale_bf16 = head_scale.bfloat16()
    return {
        "layers_fp32": (lambda: [F.linear(x[w.shape[1]], w) for layer in layers for w in layer],
                        lambda: [sk(x[w.shape[1]], w) for layer in layers for w in layer]),
        "layers_int8": (lambda: [int8pack(xb[w.shape[1]], w, sb) for layer, sbs in zip(layers8, scales_bf16)
                                 for (w, _), sb in zip(layer, sbs)],
                        lambda: [i8(x[w.shape[1]], w, s) for layer in layers8 for w, s in layer]),
        "head_fp32": (lambda: torch.ops.mkldnn._linear_pointwise(x[512], packed, None, "none", [], ""),
                      lambda: sk(x[512], head)),
        "head_int8": (lambda: int8pack(xb[512], head8, head_scale_bf16), lambda: i8(x[512], head8, head_scale)),
        "layers_int8_q8": (lambda: [int8pack(xb[w.shape[1]], w, sb) for layer, sbs in zip(layers8, scales_bf16)
                                    for (w, _), sb in zip(layer, sbs)],
                           lambda: [q8(x[w.shape[1]], w, s) for layer in layers8 for w, s in layer]),
        "head_int8_q8": (lambda: int8pack(xb[512], head8, head_scale_bf16), lambda: q8(x[512], head8, head_scale)),
    }


def _int4(n: int, k: int, g: torch.Generator, group: int = 32) -> tuple[tuple, tuple]:
    """Random int4 codes for an ``[n, k]`` layer: (torch's packed weight, its scales and zeros), (the
    kernel's codes, scale, zero) and the same in the q8 path's layout: the same values in every layout."""
    from llminfer.kernels.int4_linear import pack_int4_codes
    from llminfer.kernels.q8_linear import pack_int4_codes_q8

    n_pad = -(-n // 16) * 16  # torch's CPU packing needs N % 16 == 0
    q = torch.randint(0, 16, (n_pad, k), generator=g, dtype=torch.int32)
    scale, zero = torch.rand(n_pad, k // group, generator=g) / 50, torch.randn(n_pad, k // group, generator=g) / 50
    sz = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous().bfloat16()
    theirs = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz)
    ours = (pack_int4_codes(q[:n]), scale[:n].contiguous(), (zero - 8 * scale)[:n].contiguous())
    return theirs, ours, (pack_int4_codes_q8(q[:n]), *ours[1:])


def _extra_weights(layers, head, g) -> dict[str, Any]:
    """The bf16 (where :func:`~llminfer.kernels.build.bf16_kernel_available`) and int4 (on the VNNI
    build) weights of :func:`_extra_cases`, made once."""
    w: dict[str, Any] = {}
    if build.bf16_kernel_available():
        w["lb"] = [[t.bfloat16() for t in layer] for layer in layers]
        w["hb"] = head.bfloat16()
        w["hb_packed"] = torch.ops.mkldnn._reorder_linear_weight(w["hb"], None)
    w["l4"] = [[_int4(n, k, g) for n, k in LAYER_SHAPES] for _ in range(LAYERS)]  # the q8 path: every build
    w["h4"] = _int4(VOCAB, HIDDEN, g)
    return w


def _extra_cases(x, w: dict[str, Any]) -> dict[str, tuple[Callable, Callable]]:
    """bf16 and int4 cases: torch's kernels (oneDNN's prepacked bf16 matmul for the head,
    ``_weight_int4pack_mm_for_cpu``) against llminfer's."""
    cases: dict[str, tuple[Callable, Callable]] = {}
    xb = {k: v.bfloat16() for k, v in x.items()}
    if "lb" in w:
        bf, lb = bf16_linear, w["lb"]
        cases["layers_bf16"] = (lambda: [F.linear(xb[t.shape[1]], t) for layer in lb for t in layer],
                                lambda: [bf(xb[t.shape[1]], t) for layer in lb for t in layer])
        cases["head_bf16"] = (lambda: torch.ops.mkldnn._linear_pointwise(xb[512], w["hb_packed"], None, "none", [], ""),
                              lambda: bf(xb[512], w["hb"]))
    mm4, i4, l4, h4 = torch.ops.aten._weight_int4pack_mm_for_cpu, int4_linear, w["l4"], w["h4"]
    torch4 = lambda: [mm4(xb[o[0].shape[1] * 2], t[0], 32, t[1]) for layer in l4 for t, o, _ in layer]  # noqa: E731
    if build.int8_activation_bits():
        cases["layers_int4"] = (torch4, lambda: [i4(x[o[0].shape[1] * 2], *o, 32) for layer in l4 for _, o, _ in layer])
        cases["head_int4"] = (lambda: mm4(xb[512], h4[0][0], 32, h4[0][1]), lambda: i4(x[512], *h4[1], 32))
    i4q = int4_linear_q8
    cases["layers_int4_q8"] = (torch4, lambda: [i4q(x[o[0].shape[1] * 2], *o, 32) for layer in l4 for _, _, o in layer])
    cases["head_int4_q8"] = (lambda: mm4(xb[512], h4[0][0], 32, h4[0][1]), lambda: i4q(x[512], *h4[2], 32))
    return cases


def products(rows_list: list[int], reps: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    layers = [[torch.randn(n, k, generator=g) / k**0.5 for n, k in LAYER_SHAPES] for _ in range(LAYERS)]
    layers8 = [[(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) / 100)
                for n, k in LAYER_SHAPES] for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5
    packed = torch.ops.mkldnn._reorder_linear_weight(head, None)
    head8, head_scale = torch.randint(-127, 128, (VOCAB, HIDDEN), generator=g, dtype=torch.int8), torch.rand(VOCAB)
    extra = _extra_weights(layers, head, g)
    out = []
    for rows in rows_list:
        x = {k: torch.randn(rows, k, generator=g) for k in (512, 1536)}
        loops = 20 if rows <= 8 else 5
        cases = _product_cases(x, layers, layers8, head, packed, head8, head_scale)
        cases.update(_extra_cases(x, extra))
        for name, (torch_fn, kernel_fn) in cases.items():
            n = loops if name.startswith("layers") else max(2, loops // 5)
            t_ms, k_ms = best_ms(torch_fn, n, reps), best_ms(kernel_fn, n, reps)
            out.append({"case": name, "rows": rows, "torch_ms": t_ms, "kernel_ms": k_ms, "torch_over_kernel": t_ms / k_ms})
            print(f"{name:12s} rows {rows:3d}: torch {t_ms:8.2f} ms  kernel {k_ms:8.2f} ms  torch/kernel "
                  f"{t_ms / k_ms:5.2f}", flush=True)
    return out


def q8_against_wide(products: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each q8 case next to its wide case of the same run: ``wide_over_q8`` above 1 means the q8 path is faster
    (int4 on builds without VNNI: against torch's kernel, today's path there)."""
    by = {(p["case"], p["rows"]): p for p in products}
    out = []
    for (case, rows), p in by.items():
        if not case.endswith("_q8"):
            continue
        base = case[: -len("_q8")]
        wide_ms = by[(base, rows)]["kernel_ms"] if (base, rows) in by else p["torch_ms"]
        out.append({"case": base, "rows": rows, "wide_ms": wide_ms, "q8_ms": p["kernel_ms"],
                    "wide_over_q8": wide_ms / p["kernel_ms"]})
        print(f"{base:12s} rows {rows:3d}: wide {wide_ms:8.2f} ms  q8 {p['kernel_ms']:8.2f} ms  wide/q8 "
              f"{wide_ms / p['kernel_ms']:5.2f}", flush=True)
    return out


def attention(reps: int) -> list[dict[str, Any]]:
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    out = []
    for batch, ctx in ((1, 128), (1, 512), (32, 128), (32, 512)):
        blocks_per_seq = -(-ctx // block_size)
        cache = PagedKVCache(1, batch * blocks_per_seq + 1, block_size, kv_heads, head_dim, torch.float32, "cpu")
        cache.k[0].normal_()
        cache.v[0].normal_()
        perm = torch.randperm(batch * blocks_per_seq).tolist()
        tables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
        q = torch.randn(1, batch, heads, head_dim).transpose(1, 2)
        k = torch.randn(1, batch, kv_heads, head_dim).transpose(1, 2)
        v = torch.randn(1, batch, kv_heads, head_dim).transpose(1, 2)
        metas = {b: build_metadata(cache, [ctx - 1] * batch, [1] * batch, tables, "cpu", attention_backend=b)[0]
                 for b in ("torch", "cpu")}
        fns = {b: functools.partial(paged_attention_forward, _Layer(), q, k, v, None, scaling=0.125,
                                    llminfer_attn=m) for b, m in metas.items()}
        loops = 50 if batch == 1 else 10
        t_ms, k_ms = best_ms(fns["torch"], loops, reps), best_ms(fns["cpu"], loops, reps)
        out.append({"case": "decode_attention", "batch": batch, "context": ctx, "torch_ms": t_ms, "kernel_ms": k_ms,
                    "torch_over_kernel": t_ms / k_ms})
        print(f"attention batch {batch:2d} ctx {ctx:3d}: torch {t_ms:7.3f} ms  kernel {k_ms:7.3f} ms  torch/kernel "
              f"{t_ms / k_ms:5.2f}  (one layer)", flush=True)
    return out


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 and 32 rows only, one rep unless --reps says more")
    ap.add_argument("--reps", type=int, default=None, help="timed loops per case, best kept (default 3; 1 with --quick)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("LLMINFER_BENCH_THREADS", "2")))
    if not build.skinny_linear_available():
        print(f"SKIP: llminfer's CPU kernel is unavailable here: {build.unavailable_reason()}")
        return {"skipped": build.unavailable_reason()}
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    isa, int8_bits = build.vector_isa(), build.int8_activation_bits()
    int8_path = f"integer, {int8_bits}-bit activations (VNNI)" if int8_bits else "fp32 activations"
    print(f"kernel build: {isa}; int8 products: {int8_path}; q8 path on {build.q8_instruction()}", flush=True)
    chosen = {k: v["path"] for k, v in path_choice.quant_paths().items()}
    print(f"paths chosen here (quant_paths): {chosen}", flush=True)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    steal = StealMeter()
    with torch.inference_mode():
        payload = {"benchmark": "cpu_kernels", "threads": torch.get_num_threads(), "kernel_isa": isa,
                   "int8_path": int8_path,
                   "products": products([1, 32] if args.quick else [1, 4, 8, 32, 64], reps),
                   "q8_path": build.q8_instruction(), "quant_paths": path_choice.quant_paths(),
                   "attention": attention(reps), "reps": reps, "loadavg_before": load_before,
                   "loadavg_after": " ".join(f"{x:.2f}" for x in os.getloadavg()), "steal_pct": steal.pct(),
                   "environment": environment()}
    payload["q8_against_wide"] = q8_against_wide(payload["products"])
    print(f"load average before {load_before}, after {payload['loadavg_after']} (a loaded machine skews single "
          "rows: prefer --reps 3 with --quick)")
    if payload["steal_pct"] is not None:
        print(f"CPU time stolen by the hypervisor during the run: {payload['steal_pct']:.1f} %")
    # The build this CPU gets by default saves as cpu_kernels (what run_all reads); a forced AVX2 build on an
    # AVX-512 CPU as cpu_kernels_avx2.
    name = "cpu_kernels" if build.target_isa() == build.best_isa() else "cpu_kernels_avx2"
    if isa == "AVX-512" and "avx512_vnni" in build.cpu_flags() and not int8_bits:
        name = "cpu_kernels_novnni"  # LLMINFER_CPU_KERNEL_VNNI=0: int8 on float32 activations, for comparison
    print(f"-> {save(name, payload)}")
    return payload


if __name__ == "__main__":
    main()
