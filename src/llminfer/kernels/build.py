"""Building and loading llminfer's CPU kernel library, and what the loaded build can do.

The C++ sources (``csrc/``: one ``.cpp`` per op and the headers they share) are compiled with
``torch.utils.cpp_extension`` (a C++ compiler and ninja; about 30 s once) into one library registering the
``torch.ops.llminfer_cpu`` ops, in ``~/.cache/llminfer/cpu_kernels/<key>`` (``$LLMINFER_CACHE_DIR`` moves
``~/.cache/llminfer``, as for the built-in model), keyed by every source and header, torch's version, the
flags and the sources' folder. The library is built on first use (:func:`skinny_linear_available`); the ops'
wrappers are in :mod:`llminfer.kernels.linear`, :mod:`~llminfer.kernels.int4_linear`,
:mod:`~llminfer.kernels.bf16_linear` and :mod:`~llminfer.kernels.q8_linear`, the layers that run on them in
:mod:`llminfer.kernels.layers`.

It is built for AVX-512 (16 fp32 lanes, 32 registers: six output channels per tile instead of three) where the
CPU has AVX-512 F/BW/DQ/VL (:func:`best_isa`), else for AVX2 + FMA; ``LLMINFER_CPU_KERNEL_ISA=avx2`` forces the
AVX2 build, and :func:`vector_isa` tells which one is loaded. The AVX-512 build adds AVX-512 VNNI
(:func:`int8_activation_bits`) and AVX-512 BF16 (:func:`bf16_kernel_available`) where the CPU has them.

Every output element of every op is one fixed sequence of float operations whatever the row count, the thread
count or the row's place in a tile (the build passes ``-ffp-contract=off``, so the compiler cannot fuse the
scale-and-bias epilogue in some code paths and not others), so a row's result does not depend on what else is in
the batch. torch's GEMM does not give that: a row's bits change with ``M``, which is why no product size goes
back to it. Speed against torch's kernels: ``bench/bench_cpu_kernels.py`` and the README.

Where the library cannot be built or loaded (no compiler, no AVX2/FMA, not x86-64),
:func:`skinny_linear_available` is False with the reason in :func:`unavailable_reason`, one warning is logged,
and the callers keep torch's kernels. ``LLMINFER_CPU_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch

from llminfer.env import env_flag
from llminfer.kernels.cpu_info import cpu_flags

log = structlog.get_logger("llminfer.cpu_kernels")


#: The library's C++ folder: one ``.cpp`` per op (``skinny_linear.cpp``, ``int8_linear.cpp``, ...,
#: ``library.cpp`` defining the library) and the headers they share.
CSRC = Path(__file__).resolve().parent / "csrc"
#: The translation units compiled into the one extension.
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
#: The headers they share; the build key hashes them with :data:`SOURCES`, so a changed header rebuilds too.
HEADERS = tuple(sorted(CSRC.glob("*.h")))
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off")
#: Added to :data:`CFLAGS` for the AVX-512 build, which needs every one of :data:`AVX512_CPU_FLAGS`.
AVX512_CFLAGS = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
AVX512_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})
#: Added to the AVX-512 build where the CPU has ``avx512_vnni`` (unless ``$LLMINFER_CPU_KERNEL_VNNI`` is
#: ``0``): int8 products then run on integer dot products (:func:`~llminfer.kernels.linear.int8_linear`).
VNNI_CFLAGS = ("-mavx512vnni",)
VNNI_ENV = "LLMINFER_CPU_KERNEL_VNNI"
#: Added to the AVX2 build where the CPU has ``avx_vnni`` (Intel Alder Lake and later): the q8 path's u8 x s8
#: products then run on ``vpdpbusd`` instead of ``vpmaddubsw``.
AVXVNNI_CFLAGS = ("-mavxvnni",)
#: Added to the AVX-512 build where the CPU has ``avx512_bf16``: bf16 products then run on ``vdpbf16ps``
#: (:func:`~llminfer.kernels.bf16_linear.bf16_linear`).
BF16_CFLAGS = ("-mavx512bf16",)
#: ``0`` keeps bf16 layers on torch's matmul even where :func:`~llminfer.kernels.bf16_linear.bf16_linear` runs
#: (to compare the two).
BF16_ENV = "LLMINFER_CPU_KERNEL_BF16"
DISABLE_ENV = "LLMINFER_CPU_KERNELS"
#: ``1`` runs the kernels' parallel loops on llminfer's own worker threads (``csrc/thread_pool.h``) instead of
#: torch's OpenMP team (the default); see :func:`kernel_threads` for when that pays.
THREAD_POOL_ENV = "LLMINFER_KERNEL_THREAD_POOL"
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
    return "avx512_vnni" in cpu_flags() and env_flag(VNNI_ENV)


def _cache_dir(isa: str = "avx2") -> Path:
    from llminfer.models.builtin import default_cache_dir

    root = default_cache_dir()
    flags = " ".join(build_cflags(isa)).encode()
    # What ninja's build file holds is part of the key, else two processes sharing one folder rebuild it in
    # turn: the sources' folder (named by absolute path), torch's folder (its include paths, which differ
    # between two virtualenvs on one checkout), and the ninja that builds it (ninja 1.11 and 1.13 hash the
    # commands in their logs differently, so each takes the other's build for a changed command).
    where = "\0".join((str(SOURCES[0].resolve().parent), str(Path(torch.__file__).resolve().parent),
                       str(ninja_program()))).encode()
    key = hashlib.sha256(b"".join(src.name.encode() + src.read_bytes() for src in SOURCES + HEADERS) + flags
                         + torch.__version__.encode() + where).hexdigest()
    return root / "cpu_kernels" / key[:16]


def ninja_program() -> Path | None:
    """The ninja that builds the kernels: the one installed in this Python's environment (the ``ninja``
    package, a dependency of llminfer) whether or not that environment is activated, else the first on
    ``PATH``; None when there is none (the build then fails with torch's message)."""
    import shutil
    import sysconfig

    own = Path(sysconfig.get_path("scripts")) / "ninja"
    if own.is_file() and os.access(own, os.X_OK):
        return own
    found = shutil.which("ninja")
    return Path(found) if found else None


@contextlib.contextmanager
def _ninja_first_on_path() -> Iterator[None]:
    """``PATH`` with :func:`ninja_program`'s folder first while torch builds (torch runs ``ninja`` from ``PATH``)."""
    ninja = ninja_program()
    before = os.environ.get("PATH")
    if ninja is not None:
        os.environ["PATH"] = os.pathsep.join(p for p in (str(ninja.parent), before) if p)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def _why_not_here() -> str | None:
    if not env_flag(DISABLE_ENV):
        return f"{DISABLE_ENV}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not x86-64 ({platform.machine()})"
    flags = cpu_flags()
    if flags and not {"avx2", "fma", "f16c"} <= flags:  # every AVX2 CPU has F16C (float16 conversions)
        return "the CPU lacks AVX2, FMA or F16C"
    return None


@contextlib.contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """Hold an OS file lock on ``build`` while torch builds or loads the kernels there. torch's own lock is
    a file that a killed build leaves behind, after which every later process waits for it forever; the OS
    releases ours when its holder dies, so holding it proves torch's leftover file stale, and it is removed.
    A process that has to wait for another's build logs one warning saying so first."""
    import fcntl  # POSIX; the kernels build only on x86-64 Linux-like systems anyway

    with open(build / "llminfer.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live build (or load) in another process: say why nothing happens
            log.warning("waiting for another process that is building or loading llminfer's CPU kernels "
                        "(a first build takes a few minutes)", folder=str(build))
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build / "lock").unlink(missing_ok=True)  # torch's FileBaton of a build that died
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _announce_build(build: Path, isa: str) -> Iterator[None]:
    """Where the library is not built yet (the first use on this CPU class, source and torch), one line on
    stderr before and after the compile (minutes: 2-6 on 2 cores), and a status line on a terminal, like a
    GGUF file's first conversion; nothing where it is."""
    if (build / "llminfer_cpu_kernels.so").is_file():
        yield
        return
    import sys

    from llminfer.logging import status

    start = time.monotonic()
    print(f"llminfer: building its CPU kernels once for this CPU class ({isa}) in {build}; this takes a few "
          "minutes ...", file=sys.stderr, flush=True)
    with status("building llminfer's CPU kernels (once) ..."):
        yield
    print(f"llminfer: built the CPU kernels in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


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
                with _build_lock(build), _ninja_first_on_path(), _announce_build(build, isa):
                    cpp_extension.load(name="llminfer_cpu_kernels", sources=[str(src) for src in SOURCES],
                                       extra_cflags=list(build_cflags(isa)), extra_ldflags=["-fopenmp"],
                                       build_directory=str(build), is_python_module=False, verbose=False)
                torch.ops.llminfer_cpu.skinny_linear  # noqa: B018 - raises if the library did not register
                torch.ops.llminfer_cpu.use_kernel_thread_pool(env_flag(THREAD_POOL_ENV, default=False))
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
    bf16_linear, paged_decode_attention, rms_norm, add_rms_norm, rotary_qk), so
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

    @torch.library.register_fake("llminfer_cpu::rms_norm")
    def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("llminfer_cpu::add_rms_norm")
    def _add_rms_norm_fake(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(x, memory_format=torch.contiguous_format))

    @torch.library.register_fake("llminfer_cpu::rotary_qk")
    def _rotary_qk_fake(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q.new_empty(q.shape), k.new_empty(k.shape)

    _fakes_registered = True


def kernels_loaded() -> bool:
    """Whether the library is loaded already (never builds or loads it: for code that only takes the kernels
    where a model's layers already run on them)."""
    return _state["loaded"] is True


def skinny_linear_available() -> bool:
    """Whether ``torch.ops.llminfer_cpu.skinny_linear`` is loaded (building it on the first call)."""
    return _load()


def vector_isa() -> str | None:
    """``"AVX-512"`` or ``"AVX2"``: what the loaded kernel was built for (None where it is not loaded)."""
    if not _state["loaded"]:
        return None
    return "AVX-512" if torch.ops.llminfer_cpu.vector_bits() == 512 else "AVX2"


def int8_activation_bits() -> int | None:
    """The bits :func:`~llminfer.kernels.linear.int8_linear` rounds activations to: 14 on the AVX-512 VNNI
    build (integer dot products), None where int8 products keep float32 activations (other builds) or the
    kernel is not loaded."""
    if not _state["loaded"]:
        return None
    return int(torch.ops.llminfer_cpu.int8_activation_bits()) or None


def bf16_kernel_available() -> bool:
    """Whether :func:`~llminfer.kernels.bf16_linear.bf16_linear` runs here (the kernel loads, built for AVX-512
    with AVX-512 BF16) and ``$LLMINFER_CPU_KERNEL_BF16`` is not ``0`` / ``false`` / ``off`` / ``no``. Does not
    build the kernel."""
    if not _state["loaded"]:
        return False
    return env_flag(BF16_ENV) and bool(torch.ops.llminfer_cpu.bf16_supported())



def kernel_threads() -> str | None:
    """Which threads run the kernels' parallel loops: ``"openmp"`` (torch's team, the default) or
    ``"llminfer"`` (``$LLMINFER_KERNEL_THREAD_POOL=1``, or :func:`use_kernel_thread_pool` ``(True)``); None
    where the kernel is not loaded.

    Why the choice: libgomp keeps one team per thread that starts a parallel region, and once a second thread of
    the process has a team (any torch op of more than 32768 elements on, say, a script's main thread while the
    engine steps on its model thread) it lets idle team threads spin only about 100 iterations before they sleep:
    every kernel of a decode step then waits for a futex wake. llminfer's workers spin 2 ms after each loop
    whatever else the process runs, and keep torch's team in that short-spin regime (a parked second team), so
    its idle threads never hold the cores the workers need. The price: each of torch's own parallel regions
    wakes its thread. On a 2-core AMD EPYC (Zen 4) VM, the bench model, fp32, output tok/s:

    * with a second team (``python bench/bench_model_thread.py --foreign-team``), batch-1 decode: 22.1-22.5
      ms/token on OpenMP, 18.2-19.9 on the workers; int8-wo 11.6-12.2 against 8.3-9.1;
    * without one, eager (``run_batch_continuous``, 64 tokens, two processes each): about equal at batch 1, 8
      and 32 (47-63 / 275-334 / 509-579 OpenMP, 49-61 / 293-335 / 493-599 workers);
    * without one, compiled (``llminfer bench --backend compiled``): batch 1 62.0 against 57.6, batch 8 333.9
      against 360.6, batch 32 505.3 against 592.9: Inductor's kernels are OpenMP regions.

    So the workers are for processes that run torch work on other threads next to an eager engine.
    """
    if not _state["loaded"]:
        return None
    return "llminfer" if torch.ops.llminfer_cpu.kernel_thread_pool_enabled() else "openmp"


def use_kernel_thread_pool(on: bool) -> bool:
    """Run the kernels' parallel loops on llminfer's own worker threads (``on``) or on torch's OpenMP team;
    returns the previous setting. Results are the same bits either way (tested). The first loop on the workers
    starts them and the parked team (see :func:`kernel_threads`), which stay until the process exits.

    Raises:
        RuntimeError: the kernel is not loaded (see :func:`skinny_linear_available`).
    """
    if not _load():
        raise RuntimeError(f"llminfer's CPU kernel is not loaded: {_state['reason']}")
    return bool(torch.ops.llminfer_cpu.use_kernel_thread_pool(bool(on)))


def unavailable_reason() -> str | None:
    """Why the kernel is not in use (None when it is, or before the first :func:`skinny_linear_available`)."""
    return _state["reason"]  # type: ignore[return-value]


def q8_instruction() -> str | None:
    """The instruction the q8 path multiplies with in the loaded build (None where it is not loaded)."""
    if not _state["loaded"]:
        return None
    return str(torch.ops.llminfer_cpu.q8_instruction())


def _reset_for_tests() -> None:
    with _lock:
        _state["loaded"] = None
        _state["reason"] = None
        _state.pop("paths", None)
