"""llminfer's own CPU kernel for linear products, made for decode and used at every size (AVX-512 or AVX2 + FMA).

Besides the fp32/int8 product below, the AVX-512 build has two more where the CPU has the instructions:
:func:`bf16_linear` (AVX-512 BF16: bf16 models' products of up to :data:`BF16_KERNEL_MAX_ROWS` rows) and
:func:`int4_linear` (AVX-512 VNNI: int4-wo's group-wise products at every row count). Every build also has
the q8 path (:func:`int8_linear_q8`, :func:`int4_linear_q8`: 8-bit activations per block of 32 columns on u8 x
s8 dot products, as llama.cpp's Q8_0), and :func:`quant_paths` picks per build, by a short measurement kept
with the build, which path int8-wo and int4-wo layers take.

``torch.ops.llminfer_cpu.skinny_linear(x, weight, scale=None, bias=None)`` computes
``x @ (weight * scale[:, None]).T + bias`` for a float32 ``x`` ``[M, K]`` and a float32 or int8 ``weight``
``[N, K]`` (``K % 8 == 0``), accumulating in float32 (source: ``csrc/cpu_kernels.cpp``). It is made for the
decode step, where ``M`` (the step's rows) is small and the product is bound by the weight bytes read:
each thread reads a tile of output channels once for four activation rows at a time (for a single row,
one channel after another, so the tile is one sequential stream). :func:`int8_linear` is the int8-wo
layers' entry: the same product, or on an AVX-512 VNNI CPU one on integer dot products. Measured on an AMD
EPYC with AVX2 only (2 threads, ``python bench/bench_cpu_kernels.py``): the 56 fp32 linear layers of the
bench model 1.5x faster than ``F.linear`` at 1 row and 1.3-3.3x at 4-64 rows; the int8 layers and LM head
1.2-2.1x faster than ``aten._weight_int8pack_mm`` (bf16 activations) from 1 to 64 rows. Every fp32 and
int8 product takes the kernel, prefill-sized ones included: with more than four rows each thread holds a
block of tiles' weights in L2 while every group of four rows passes over it, which on a 2-core AMD EPYC
(Zen 4, AVX-512) ran the bench model's fp32 layers at 0.7-1.0x torch's GEMM speed from 128 to 1024 rows
(a one-off timing of ``skinny_linear`` against ``F.linear`` on those shapes).

Every output element is the same fixed sequence of fp32 operations whatever ``M``, the thread count or
the row's place in a tile (the build passes ``-ffp-contract=off``, so the compiler cannot fuse the
scale-and-bias epilogue in some code paths and not others), so a row's result does not depend on what
else is in the batch. torch's GEMM does not give that: a row's bits change with ``M``, which is why no
product size goes back to it.

The C++ source is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; about 30 s
once) into ``~/.cache/llminfer/cpu_kernels/<key>`` (``$LLMINFER_CACHE_DIR`` moves ``~/.cache/llminfer``, as for
the built-in model), keyed by the source, torch's version and the flags. It is built for AVX-512 (16 fp32
lanes, 32 registers: six output channels per tile instead of three) where the CPU has AVX-512 F/BW/DQ/VL
(:func:`best_isa`), else for AVX2 + FMA; ``LLMINFER_CPU_KERNEL_ISA=avx2`` forces the AVX2 build, and
:func:`vector_isa` tells which one is loaded. Measured with ``bench/bench_cpu_kernels.py --quick``, each
build back to back, as ratios to the same torch kernels: on an Intel Xeon (Sapphire Rapids, 2 threads) at
1 row both builds stream the weights at the bandwidth (torch/kernel 1.09 vs 0.99 for the fp32 layers,
1.44 vs 1.56 for the int8 head) and at 32 rows the AVX-512 build is the faster one (fp32 layers 1.35 vs
0.93, int8 layers 1.37 vs 0.92, fp32 head 0.92 vs 0.59, int8 head 1.43 vs 0.92); on an AMD EPYC (Zen 4,
``--reps 3``, two rounds of each build) the fp32 layers 2.08-2.15 vs 1.70-1.98 at 1 row and
1.37-1.56 vs 1.14-1.24 at 32 rows (before the one-row sequential stream and the VNNI path; after them,
``--quick`` on the same CPU: fp32 layers 2.58 at 1 row and 1.35 at 32, int8 layers against
``_weight_int8pack_mm`` 1.68 and 1.43, the int8 head 1.37 and 1.44, the fp32 head against oneDNN 1.23 at
1 row and 0.86 at 32). Where it cannot be built or loaded (no compiler, no AVX2/FMA, not x86-64),
:func:`skinny_linear_available` is False with the reason in :func:`unavailable_reason`, one warning is
logged, and the callers keep torch's kernels. ``LLMINFER_CPU_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from llminfer.backends.cpu_info import cpu_flags, cpu_model

log = structlog.get_logger("llminfer.cpu_kernels")

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.cpp"
#: Every source of the library (one extension; the build key hashes them all): the main file and the
#: 8-bit-activation products (``csrc/cpu_kernels_q8.cpp``).
SOURCES = (SOURCE, SOURCE.with_name("cpu_kernels_q8.cpp"))
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off")
#: Added to :data:`CFLAGS` for the AVX-512 build, which needs every one of :data:`AVX512_CPU_FLAGS`.
AVX512_CFLAGS = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
AVX512_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})
#: Added to the AVX-512 build where the CPU has ``avx512_vnni`` (unless ``$LLMINFER_CPU_KERNEL_VNNI`` is
#: ``0``): int8 products then run on integer dot products (:func:`int8_linear`).
VNNI_CFLAGS = ("-mavx512vnni",)
VNNI_ENV = "LLMINFER_CPU_KERNEL_VNNI"
#: Added to the AVX2 build where the CPU has ``avx_vnni`` (Intel Alder Lake and later): the q8 path's u8 x s8
#: products then run on ``vpdpbusd`` instead of ``vpmaddubsw``.
AVXVNNI_CFLAGS = ("-mavxvnni",)
#: Added to the AVX-512 build where the CPU has ``avx512_bf16``: bf16 products then run on ``vdpbf16ps``
#: (:func:`bf16_linear`).
BF16_CFLAGS = ("-mavx512bf16",)
#: ``0`` keeps bf16 layers on torch's matmul even where :func:`bf16_linear` runs (to compare the two).
BF16_ENV = "LLMINFER_CPU_KERNEL_BF16"
#: bf16 products of at most this many rows run on :func:`bf16_linear`; larger ones on torch's matmul
#: (oneDNN, AMX where the CPU has it). Measured on a 2-core Xeon with AMX (cold caches, ms): the 151k x 512
#: head at 1 / 4 / 8 / 32 rows 5.97 / 7.27 / 10.4 / 29.5 on the kernel against 7.10 / 7.12 / 7.18 / 8.87
#: on oneDNN's prepacked matmul; a 1536 x 512 layer 0.015 / 0.034 / 0.067 against 0.056 / 0.056 / 0.057.
#: vdpbf16ps retires no more products per cycle than fp32 FMAs on that CPU, so past a few rows AMX wins.
BF16_KERNEL_MAX_ROWS = 4
DISABLE_ENV = "LLMINFER_CPU_KERNELS"
ISA_ENV = "LLMINFER_CPU_KERNEL_ISA"

_lock = threading.Lock()
_state: dict[str, Any] = {"loaded": None, "reason": None}


def best_isa() -> str:
    """The widest ISA this CPU can run the kernel in: ``"avx512"`` where it has all of
    :data:`AVX512_CPU_FLAGS`, else ``"avx2"``."""
    return "avx512" if AVX512_CPU_FLAGS <= cpu_flags() else "avx2"


def target_isa() -> str:
    """The ISA the kernel is (to be) built for: :func:`best_isa`, unless ``$LLMINFER_CPU_KERNEL_ISA`` is
    ``avx2`` (the AVX2 build on any CPU). ``avx512`` or ``auto`` (or unset) ask for the best; a CPU without
    AVX-512 then gets the AVX2 build."""
    if os.environ.get(ISA_ENV, "").strip().lower() == "avx2":
        return "avx2"
    return best_isa()


def build_cflags(isa: str) -> tuple[str, ...]:
    """The compiler flags of the build for ``isa`` (``"avx2"`` or ``"avx512"``; the AVX-512 build adds
    :data:`VNNI_CFLAGS` where the CPU has ``avx512_vnni``)."""
    if isa != "avx512":  # AVX-VNNI (vpdpbusd on ymm) for the q8 path where the CPU has it
        return CFLAGS + (AVXVNNI_CFLAGS if "avx_vnni" in cpu_flags() else ())
    bf16 = BF16_CFLAGS if "avx512_bf16" in cpu_flags() else ()
    return CFLAGS + AVX512_CFLAGS + (VNNI_CFLAGS if vnni_wanted() else ()) + bf16


def vnni_wanted() -> bool:
    """Whether the AVX-512 build takes VNNI: the CPU has ``avx512_vnni`` and ``$LLMINFER_CPU_KERNEL_VNNI``
    is not ``0`` / ``false`` / ``off`` / ``no`` (which keeps int8 products on float32 activations)."""
    off = os.environ.get(VNNI_ENV, "1").strip().lower() in ("0", "false", "off", "no")
    return "avx512_vnni" in cpu_flags() and not off


def _cache_dir(isa: str = "avx2") -> Path:
    from llminfer.models.builtin import default_cache_dir

    root = default_cache_dir()
    flags = " ".join(build_cflags(isa)).encode()
    # The sources' folder is part of the key: ninja's build file names them by absolute path, so two checkouts
    # sharing one folder would rebuild it in turn.
    where = str(SOURCES[0].resolve().parent).encode()
    key = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES) + flags + torch.__version__.encode()
                         + where).hexdigest()
    return root / "cpu_kernels" / key[:16]


def _why_not_here() -> str | None:
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return f"{DISABLE_ENV}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not x86-64 ({platform.machine()})"
    flags = cpu_flags()
    if flags and not {"avx2", "fma"} <= flags:
        return "the CPU lacks AVX2 or FMA"
    return None


@contextlib.contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """Hold an OS file lock on ``build`` while torch builds or loads the kernels there. torch's own lock is
    a file that a killed build leaves behind, after which every later process waits for it forever; the OS
    releases ours when its holder dies, so holding it proves torch's leftover file stale, and it is removed."""
    import fcntl  # POSIX; the kernels build only on x86-64 Linux-like systems anyway

    with open(build / "llminfer.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits only for a live build in another process
        try:
            (build / "lock").unlink(missing_ok=True)  # torch's FileBaton of a build that died
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load() -> bool:
    with _lock:
        if _state["loaded"] is not None:
            return bool(_state["loaded"])
        reason = _why_not_here()
        if reason is None:
            try:
                from torch.utils import cpp_extension

                isa = target_isa()
                build = _cache_dir(isa)
                build.mkdir(parents=True, exist_ok=True)
                with _build_lock(build):
                    cpp_extension.load(name="llminfer_cpu_kernels", sources=[str(src) for src in SOURCES],
                                       extra_cflags=list(build_cflags(isa)), extra_ldflags=["-fopenmp"],
                                       build_directory=str(build), is_python_module=False, verbose=False)
                torch.ops.llminfer_cpu.skinny_linear  # noqa: B018 - raises if the library did not register
                _register_fake_impls()
            except Exception as exc:  # noqa: BLE001 - compiler, ninja, loader: any failure means "use torch"
                lines = str(exc).strip().splitlines()
                reason = f"build failed: {lines[-1][:200] if lines else type(exc).__name__}"
        _state["loaded"] = reason is None
        _state["reason"] = reason
        if reason is not None and not reason.startswith(DISABLE_ENV):
            log.warning("llminfer CPU kernel unavailable; torch's kernels are used", reason=reason)
        return reason is None


_fakes_registered = False


def _register_fake_impls() -> None:
    """Shape-only implementations of the ops (skinny_linear, int8_linear, int4_linear, their q8 forms,
    bf16_linear, paged_decode_attention), so
    ``torch.compile`` (the compiled backend) traces through them and inductor calls them as extern kernels
    instead of breaking the graph. Once per process:
    the C++ library outlives :func:`_reset_for_tests`."""
    global _fakes_registered
    if _fakes_registered:
        return

    @torch.library.register_fake("llminfer_cpu::skinny_linear")
    def _skinny_linear_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)

    @torch.library.register_fake("llminfer_cpu::int8_linear")
    def _int8_linear_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)

    @torch.library.register_fake("llminfer_cpu::int4_linear")
    def _int4_linear_fake(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], codes.shape[0], dtype=torch.float32)

    @torch.library.register_fake("llminfer_cpu::int8_linear_q8")
    def _int8_linear_q8_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)

    @torch.library.register_fake("llminfer_cpu::int4_linear_q8")
    def _int4_linear_q8_fake(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                             group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], codes.shape[0], dtype=torch.float32)

    @torch.library.register_fake("llminfer_cpu::bf16_linear")
    def _bf16_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)

    @torch.library.register_fake("llminfer_cpu::paged_decode_attention")
    def _paged_decode_attention_fake(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
        return query.new_empty(query.shape, dtype=torch.float32)

    _fakes_registered = True


def skinny_linear_available() -> bool:
    """Whether ``torch.ops.llminfer_cpu.skinny_linear`` is loaded (building it on the first call)."""
    return _load()


def vector_isa() -> str | None:
    """``"AVX-512"`` or ``"AVX2"``: what the loaded kernel was built for (None where it is not loaded)."""
    if not _state["loaded"]:
        return None
    return "AVX-512" if torch.ops.llminfer_cpu.vector_bits() == 512 else "AVX2"


def int8_activation_bits() -> int | None:
    """The bits :func:`int8_linear` rounds activations to: 14 on the AVX-512 VNNI build (integer dot
    products), None where int8 products keep float32 activations (other builds) or the kernel is not loaded."""
    if not _state["loaded"]:
        return None
    return int(torch.ops.llminfer_cpu.int8_activation_bits()) or None


def bf16_kernel_available() -> bool:
    """Whether :func:`bf16_linear` runs here (the kernel loads, built for AVX-512 with AVX-512 BF16) and
    ``$LLMINFER_CPU_KERNEL_BF16`` is not ``0`` / ``false`` / ``off`` / ``no``. Does not build the kernel."""
    if not _state["loaded"]:
        return False
    off = os.environ.get(BF16_ENV, "1").strip().lower() in ("0", "false", "off", "no")
    return not off and bool(torch.ops.llminfer_cpu.bf16_supported())


def unavailable_reason() -> str | None:
    """Why the kernel is not in use (None when it is, or before the first :func:`skinny_linear_available`)."""
    return _state["reason"]  # type: ignore[return-value]


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` on the kernel.

    Args:
        x: float32 ``[M, K]``, contiguous, on CPU, ``K % 8 == 0``.
        weight: float32 or int8 ``[N, K]``, contiguous.
        scale: float32 ``[N]`` per-output-channel scale (int8 weights), or None.
        bias: float32 ``[N]``, or None.

    Returns:
        float32 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded, or the arguments break the rules above.
    """
    return torch.ops.llminfer_cpu.skinny_linear(x, weight, scale, bias)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` for an int8 ``weight``: on integer dot products where the
    kernel is the AVX-512 VNNI build (:func:`int8_activation_bits` is 14) and ``K % 32 == 0``,
    ``K <= 32768``; elsewhere exactly :func:`skinny_linear` (float32 activations).

    The integer path rounds each activation row on its own to 14 bits (``sx = max|x| / 8191`` in float32,
    ``q = round(x / sx)`` to nearest even), sums ``q * weight`` exactly (``vpdpwssd`` into int32 lanes, the
    lanes in int64) and returns ``float32(double(dot) * sx * scale) + bias``. Exact sums make a row's result
    independent of the batch, the threads and the order of the sums; against float32 activations it differs
    by the rounding of the activations (at most half a step of ``max|x| / 8191`` per element). A row holding
    a NaN or an infinity gives NaN outputs. The scheme is symmetric per-token activation quantization (as
    in ZeroQuant and SmoothQuant's W8A8) with 14 bits instead of 8, which keeps int8-wo's agreement with
    the float model (``bench/bench_quant.py``) while the products run on integer instructions.

    Args:
        x: float32 ``[M, K]``, contiguous, on CPU, ``K % 8 == 0``.
        weight: int8 ``[N, K]``, contiguous, values in [-127, 127].
        scale: float32 ``[N]`` per-output-channel scale.
        bias: float32 ``[N]``, or None.

    Returns:
        float32 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded, or the arguments break the rules above.
    """
    return torch.ops.llminfer_cpu.int8_linear(x, weight, scale, bias)


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for group-wise int4 weights ``W[n, k] = q[n, k] * scale[n, g] + zero[n, g]``
    (``g = k // group_size``), on AVX-512 VNNI integer dot products (:func:`int8_activation_bits` is 14).

    Activations are rounded per row to 14 bits as in :func:`int8_linear`; each group's dot product with
    the codes is exact (int32), then added in float32 times the group's scale, in one fixed order, with the
    zero points' term from each group's sum of the rounded activations. A row's result does not depend on
    the other rows or the threads. The scheme is llama.cpp's Q4_0 / Q4_1 block dot product with 14-bit
    instead of 8-bit activations.

    Args:
        x: float32 ``[M, K]``, contiguous, on CPU.
        codes: uint8 ``[N, ceil(K / 128) * 64]`` from :func:`llminfer.backends.weight_only.pack_int4_codes`
            (four codes to a 16-bit word).
        scale, zero: float32 ``[N, K // group_size]``, contiguous, on CPU (``zero`` is the layer's zero point
            less ``8 * scale`` for :class:`~llminfer.backends.weight_only.Int4WeightOnlyLinear`'s codes).
        group_size: 32, 64, 128 or 256, dividing ``K``; ``0 < K <= 32768``.
        bias: float32 ``[N]``, or None.

    Returns:
        float32 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded or has no VNNI path, or the arguments break the rules above.
    """
    return torch.ops.llminfer_cpu.int4_linear(x, codes, scale, zero, group_size, bias)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for bf16 ``x`` and ``weight`` on ``vdpbf16ps`` (AVX-512 BF16).

    Each output element is accumulated in float32 in one fixed order (16 lanes of pairwise bf16 products
    over ``k``, a fixed lane sum, then the bias) and rounded once to bf16 (nearest even), so a row's result
    does not depend on the other rows, the thread count or the row's place in a tile. Against a float64
    reference it differs by float32 accumulation and that one bf16 rounding; denormal inputs count as zero
    (the instruction's rule).

    Args:
        x: bfloat16 ``[M, K]``, contiguous, on CPU, ``K % 32 == 0``.
        weight: bfloat16 ``[N, K]``, contiguous.
        bias: bfloat16 or float32 ``[N]``, or None.

    Returns:
        bfloat16 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded or has no BF16 path (:func:`bf16_kernel_available`), or the
            arguments break the rules above.
    """
    return torch.ops.llminfer_cpu.bf16_linear(x, weight, bias)


# --------------------------------------------------------------------------- products on 8-bit activations
#: ``q8`` or ``wide`` forces the int8-wo products onto :func:`int8_linear_q8` or :func:`int8_linear`; ``auto``
#: (or unset) takes the faster here, measured once per build (:func:`quant_paths`).
INT8_PATH_ENV = "LLMINFER_CPU_KERNEL_INT8_PATH"
#: The same for int4-wo: :func:`int4_linear_q8`, or ``wide`` (:func:`int4_linear` on the AVX-512 VNNI
#: build, torch's int4 kernel elsewhere).
INT4_PATH_ENV = "LLMINFER_CPU_KERNEL_INT4_PATH"
QUANT_PATHS = ("q8", "wide")
#: Where the measured choice is kept, in the build's folder (so it follows the source, flags and torch).
PATHS_FILE = "quant_paths.json"


def int8_linear_q8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` for an int8 ``weight`` on u8 x s8 integer dot products
    with 8-bit activations (the "q8" path; source: ``csrc/cpu_kernels_q8.cpp``).

    Each activation row is rounded per block of 32 columns as llama.cpp's Q8_0 does
    (``d = max|x| / 127`` in float32, ``q = round(x / d)`` to nearest even). The products of a block run on
    ``vpdpbusd`` (AVX-512 VNNI, 64 columns an instruction; AVX-VNNI, 32), the weights made unsigned with
    ``w + 128`` and each lane started at ``-128 * sum(q)`` of its columns, or on ``vpmaddubsw`` (plain AVX2)
    with llama.cpp's sign trick (``|q|`` times ``w`` with ``q``'s sign): exact int32 lane sums either way.
    Each lane's sum is added in float32 times its block's ``d``, then the lanes in a fixed order, times
    ``scale``, plus ``bias``: one fixed sequence per output element, so a row's result does not depend on
    the batch or the threads. Against the float product the error is the activation rounding:
    ``|out - x @ W.T| <= scale[n] * sum_k |weight[n, k]| * d[b(k)] / 2`` plus float32 sums. A block holding
    a NaN or an infinity makes the row's outputs NaN.

    Args:
        x: float32 ``[M, K]``, contiguous, on CPU, ``K % 32 == 0``.
        weight: int8 ``[N, K]``, contiguous, values in [-127, 127] (-128 would break the sign trick).
        scale: float32 ``[N]`` per-output-channel scale.
        bias: float32 ``[N]``, or None.

    Returns:
        float32 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded, or the arguments break the rules above.
    """
    return torch.ops.llminfer_cpu.int8_linear_q8(x, weight, scale, bias)


def int4_linear_q8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for group-wise int4 weights ``W[n, k] = q[n, k] * scale[n, g] + zero[n, g]`` on u8 x
    s8 integer dot products with 8-bit activations (the "q8" path, any x86 build).

    Activations are rounded per block of 32 columns as in :func:`int8_linear_q8`; the codes are the
    unsigned operand (``vpdpbusd``, or ``vpmaddubsw`` on plain AVX2), each lane's exact sum is added in
    float32 times its block's ``d`` and its group's scale, and the zero points' term uses each group's sum of
    the float32 activations. llama.cpp's Q4_1 x Q8_0 block product, with llminfer's layout and group sizes.
    A row's result does not depend on the other rows or the threads.

    Args:
        x: float32 ``[M, K]``, contiguous, on CPU.
        codes: uint8 ``[N, ceil(K / 128) * 64]`` from
            :func:`llminfer.backends.weight_only.pack_int4_codes_q8`.
        scale, zero: float32 ``[N, K // group_size]``, contiguous, on CPU.
        group_size: 32, 64, 128 or 256, dividing ``K``.
        bias: float32 ``[N]``, or None.

    Returns:
        float32 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded, or the arguments break the rules above.
    """
    return torch.ops.llminfer_cpu.int4_linear_q8(x, codes, scale, zero, group_size, bias)


def q8_instruction() -> str | None:
    """The instruction the q8 path multiplies with in the loaded build (None where it is not loaded)."""
    if not _state["loaded"]:
        return None
    return str(torch.ops.llminfer_cpu.q8_instruction())


def _forced_path(env: str) -> str | None:
    value = os.environ.get(env, "auto").strip().lower() or "auto"
    if value == "auto":
        return None
    if value not in QUANT_PATHS:
        raise ValueError(f"{env} must be one of q8, wide or auto, got {value!r}")
    return value


def _best_ms(fn, loops: int = 2) -> float:
    import time

    start = time.perf_counter()
    for _ in range(loops):
        fn()
    return (time.perf_counter() - start) / loops * 1e3


def _race(a, b, rounds: int = 3) -> tuple[float, float]:
    """The best ms per call of ``a`` and ``b``, timed alternately (ABAB) after one warm-up call each."""
    a()
    b()
    ta = tb = float("inf")
    for _ in range(rounds):
        ta = min(ta, _best_ms(a))
        tb = min(tb, _best_ms(b))
    return ta, tb


def _measure_paths() -> dict[str, dict]:
    """Time both paths on the products of a decode step at batch 1 and at batch 8 (1 and 8 rows over 8 MB
    of int8 weights, past the L2 caches), alternately, and keep per kind the path with the smaller sum of the
    two (the q8 path's per-block float steps cost more per row as the rows grow, so a path that wins at one
    row can lose at eight). Tens of ms on a 2-core Zen 4."""
    n, k, g = 8192, 1024, 32
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, k, generator=gen) for rows in (1, 8)]
    w8 = torch.full((n, k), 37, dtype=torch.int8)  # any values: the instructions' timing does not depend on them
    ones = torch.ones(n)
    s, z = torch.ones(n, k // g), torch.zeros(n, k // g)
    codes = torch.full((n, -(-k // 128) * 64), 0x5A, dtype=torch.uint8)
    if int8_activation_bits():
        wide4 = lambda x: int4_linear(x, codes, s, z, g)  # noqa: E731
        label4 = "int4_linear"
    else:  # no VNNI: today's int4 path is torch's kernel (bf16 activations)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.full((n, k), 5, dtype=torch.int32), 1)
        sz = torch.stack([s, z], dim=2).transpose(0, 1).contiguous().bfloat16()
        wide4 = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, g, sz)  # noqa: E731
        label4 = "torch's _weight_int4pack_mm_for_cpu"
    pairs = {"int8": (lambda x: int8_linear_q8(x, w8, ones), lambda x: int8_linear(x, w8, ones), "int8_linear"),
             "int4": (lambda x: int4_linear_q8(x, codes, s, z, g), wide4, label4)}
    found: dict[str, dict] = {}
    for kind, (q8, wide, label) in pairs.items():
        q8_ms = wide_ms = 0.0
        for x in xs:
            a, b = _race(lambda: q8(x), lambda: wide(x))  # noqa: B023 - called before x moves on
            q8_ms, wide_ms = q8_ms + a, wide_ms + b
        found[kind] = {"path": "q8" if q8_ms <= wide_ms else "wide", "how": "measured", "q8_ms": round(q8_ms, 4),
                       "wide_ms": round(wide_ms, 4), "wide": label}
    return found


def quant_paths() -> dict[str, dict]:
    """Which path the int8-wo and int4-wo layers take here: ``{"int8": {...}, "int4": {...}}``, each with
    ``path`` (``"q8"``: :func:`int8_linear_q8` / :func:`int4_linear_q8`; ``"wide"``: :func:`int8_linear` /
    :func:`int4_linear`, or torch's int4 kernel on builds without AVX-512 VNNI) and ``how`` (``"forced"`` by
    :data:`INT8_PATH_ENV` / :data:`INT4_PATH_ENV`, or ``"measured"``, then with the ``q8_ms`` and ``wide_ms``
    of the measurement).

    The measurement (:func:`_measure_paths`, tens of ms) runs once per build, the first time a model
    needs it, and is kept in the build's folder (:data:`PATHS_FILE`, keyed like the build by the sources,
    the flags and torch's version; the CPU model is stored and checked too), so later processes read it.

    Raises:
        ValueError: an environment variable above holds something other than ``q8``, ``wide`` or ``auto``.
        RuntimeError: the kernel is not loaded.
    """
    import json

    forced = {"int8": _forced_path(INT8_PATH_ENV), "int4": _forced_path(INT4_PATH_ENV)}
    if not _load():
        raise RuntimeError(f"llminfer's CPU kernel is not loaded: {unavailable_reason()}")
    with _lock:
        measured = _state.get("paths")
        if measured is None and not all(forced.values()):
            cpu = cpu_model()
            path = _cache_dir(target_isa()) / PATHS_FILE
            try:
                kept = json.loads(path.read_text())
                measured = kept["paths"] if kept.get("cpu") == cpu and kept.get("threads") == torch.get_num_threads() else None
            except (OSError, ValueError, KeyError):
                measured = None
            if measured is None:
                with torch.inference_mode():
                    measured = _measure_paths()
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                try:
                    tmp.write_text(json.dumps({"cpu": cpu, "threads": torch.get_num_threads(), "paths": measured}))
                    os.replace(tmp, path)
                except OSError:
                    pass
                log.info("quantized kernel paths measured", **{k: v["path"] for k, v in measured.items()})
            _state["paths"] = measured
    out: dict[str, dict] = {}
    for kind, force in forced.items():
        out[kind] = {"path": force, "how": "forced"} if force else dict(measured[kind])
    return out


def quant_path_note(kind: str) -> str:
    """One line on the path ``kind`` (``"int8"`` or ``"int4"``) takes and why, for ``llminfer info``: e.g.
    ``"q8 path (vpdpbusd zmm (AVX-512 VNNI), 8-bit activations per 32 columns), measured here: q8 1.75 ms,
    wide 3.49 ms"``.

    Raises:
        ValueError, RuntimeError: as :func:`quant_paths`.
    """
    p = quant_paths()[kind]
    what = (f"q8 path ({q8_instruction()}, 8-bit activations per 32 columns)" if p["path"] == "q8"
            else "wide path")
    if p["how"] == "forced":
        return f"{what}, forced by {INT8_PATH_ENV if kind == 'int8' else INT4_PATH_ENV}"
    return f"{what}, measured here: q8 {p['q8_ms']:.2f} ms, wide ({p['wide']}) {p['wide_ms']:.2f} ms"


class SkinnyLinear(nn.Linear):
    """A drop-in for an fp32 or bf16 ``nn.Linear`` that runs its products on :func:`skinny_linear` (fp32)
    or :func:`bf16_linear` (bf16, where :func:`bf16_kernel_available`).

    It is an ``nn.Linear`` holding the same ``weight`` and ``bias`` parameters (ties, ``state_dict`` keys
    and PEFT wrapping unchanged). Input ``[..., in_features]`` float32 on CPU with any number of rows, no
    autograd, gives ``[..., out_features]`` float32 from the kernel (the same bits for a row whatever the
    other rows); bf16 input likewise up to :data:`BF16_KERNEL_MAX_ROWS` rows, and ``F.linear`` (oneDNN)
    beyond, so a bf16 row's bits do depend on the step's size, as they do with torch alone. Anything else
    (another dtype or device, a non-contiguous weight, gradients) takes ``F.linear``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        from llminfer.backends.prepack import adopt_linear

        adopt_linear(self, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.dtype != w.dtype or w.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu"
                or w.device.type != "cpu" or not w.is_contiguous()
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return F.linear(x, w, self.bias)
        rows = x.numel() // max(1, self.in_features)
        if w.dtype == torch.bfloat16 and rows > BF16_KERNEL_MAX_ROWS:
            return F.linear(x, w, self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()
        if w.dtype == torch.float32:
            out = skinny_linear(flat, w, None, self.bias)
        else:
            out = bf16_linear(flat, w, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def enable_cpu_kernels(model: nn.Module, include_head: bool = False) -> int:
    """Put ``model``'s linear products on llminfer's kernels, in place, where they build and load here:
    every fp32 CPU ``nn.Linear`` (modules of exactly that type with ``in_features % 8 == 0``) and, where
    :func:`bf16_kernel_available`, every bf16 one with ``in_features % 32 == 0`` becomes a
    :class:`SkinnyLinear`; the LM head only with ``include_head`` (the eager backend puts it on oneDNN
    with :func:`llminfer.backends.prepack.prepack_lm_head`, whose lazily packed weight does not trace under
    ``torch.compile``, so the compiled backend takes the kernel for it). Every
    :class:`~llminfer.backends.weight_only.Int8WeightOnlyLinear` (the head included) takes the kernel for
    any row count (:func:`int8_linear_q8` or :func:`int8_linear`, as :func:`quant_paths` chose), and so does
    every :class:`~llminfer.backends.weight_only.Int4WeightOnlyLinear` (:func:`int4_linear_q8`, or
    :func:`int4_linear` where the kernel has its VNNI path and that path was chosen; the codes are re-laid
    out in place).

    Args:
        model: the loaded model (modules swapped in place).
        include_head: also put an fp32 or bf16 ``nn.Linear`` LM head on the kernel (the compiled backend).

    Returns:
        How many layers now use the kernel (0 where it is unavailable: see :func:`unavailable_reason`).
    """
    from llminfer.backends.weight_only import Int4WeightOnlyLinear, Int8WeightOnlyLinear

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plain = [(name, m) for name, m in model.named_modules()
             if type(m) is nn.Linear and (include_head or m is not head) and m.weight.device.type == "cpu"]
    fp32 = [(n, m) for n, m in plain if m.weight.dtype == torch.float32 and m.in_features % 8 == 0]
    bf16 = [(n, m) for n, m in plain if m.weight.dtype == torch.bfloat16 and m.in_features % 32 == 0]
    int8 = [m for m in model.modules() if isinstance(m, Int8WeightOnlyLinear) and m.weight.device.type == "cpu"]
    int4 = [m for m in model.modules() if isinstance(m, Int4WeightOnlyLinear) and m.weight.device.type == "cpu"]
    if not (fp32 or bf16 or int8 or int4) or not skinny_linear_available():
        return 0
    paths = quant_paths() if (int8 or int4) else {"int8": {"path": "wide"}, "int4": {"path": "wide"}}
    swapped = fp32 + (bf16 if bf16_kernel_available() else [])
    for name, linear in swapped:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, SkinnyLinear(linear))
    for layer in int8:
        layer.use_cpu_kernel = True
        layer.kernel_path = "q8" if paths["int8"]["path"] == "q8" and layer.in_features % 32 == 0 else "wide"
        layer._kernel_scales = layer.scales.float().contiguous()  # now, not inside a torch.compile trace
    int4_path = paths["int4"]["path"]
    if int4_path == "wide":  # int4_linear needs the VNNI integer path (and K <= 32768); else torch's kernel stays
        int4 = [m for m in int4 if m.in_features <= 32768] if int8_activation_bits() is not None else []
    for layer in int4:
        layer.use_llminfer_kernel(int4_path)
    return len(swapped) + len(int8) + len(int4)


def _reset_for_tests() -> None:
    with _lock:
        _state["loaded"] = None
        _state["reason"] = None
        _state.pop("paths", None)
