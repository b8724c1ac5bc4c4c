"""Which product the int8-wo and int4-wo layers take on this CPU: the q8 path (8-bit activations per block of 32
columns, :mod:`llminfer.kernels.q8_linear`) or the wide one (:mod:`llminfer.kernels.linear`,
:mod:`llminfer.kernels.int4_linear`, or torch's int4 kernel where the build has no VNNI), measured once per build
(:func:`quant_paths`) or forced by the environment."""

from __future__ import annotations

import os

import structlog
import torch

from llminfer.kernels import build
from llminfer.kernels.cpu_info import cpu_model
from llminfer.kernels.int4_linear import int4_linear
from llminfer.kernels.linear import int8_linear
from llminfer.kernels.q8_linear import int8_linear_q8

log = structlog.get_logger("llminfer.cpu_kernels")

# --------------------------------------------------------------------------- products on 8-bit activations
#: ``q8`` or ``wide`` forces the int8 products onto the q8 path (:func:`int8_linear_q8` for one scale per
#: channel, :func:`~llminfer.kernels.int8_group_linear.int8_group_linear_q8` for int8-wo's groups of 32) or the
#: wide one (:func:`int8_linear`, :func:`~llminfer.kernels.int8_group_linear.int8_group_linear`); ``auto`` (or
#: unset) takes the faster here, measured once per build (:func:`quant_paths`).
INT8_PATH_ENV = "LLMINFER_CPU_KERNEL_INT8_PATH"
#: The same for int4-wo: :func:`~llminfer.kernels.q8_linear.int4_linear_q8` (for groups of 32
#: :func:`~llminfer.kernels.int8_group_linear.int4_group_linear_q8`), or ``wide`` (:func:`int4_linear` on the AVX-512 VNNI
#: build, torch's int4 kernel elsewhere).
INT4_PATH_ENV = "LLMINFER_CPU_KERNEL_INT4_PATH"
QUANT_PATHS = ("q8", "wide")
#: Where the measured choice is kept, in the build's folder (so it follows the source, flags and torch).
PATHS_FILE = "quant_paths.json"
#: For int8-wo's per-channel scales (one 8-bit digit per activation), the q8 path is taken only where it is at
#: least this much faster than the wide one (q8 time <= this times the wide time): 8-bit activations flip more
#: top-1 tokens than the wide path's 14-bit ones (on the trained SmolLM2, int4-wo agreed with fp32 on 91 % of
#: positions on one digit and 99 % on wide), so a tie or a few percent is not worth it. The group-wise kinds
#: (``int8-group``, ``int4``) use two digits, as exact as the wide path, and take the faster. Stored with the
#: measurement, so a changed rule measures again.
Q8_MAX_TIME_RATIO = 0.9


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
    of int8 weights, past the L2 caches), alternately, and compare per kind the sums of the two (the q8
    path's per-block float steps cost more per row as the rows grow, so a path that wins at one row can lose
    at eight): q8 where its sum is at most the wide one's (times :data:`Q8_MAX_TIME_RATIO` for ``int8``), else
    wide."""
    n, k, g = 8192, 1024, 32
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, k, generator=gen) for rows in (1, 8)]
    w8 = torch.full((n, k), 37, dtype=torch.int8)  # any values: the instructions' timing does not depend on them
    ones = torch.ones(n)
    s, z = torch.ones(n, k // g), torch.zeros(n, k // g)
    codes = torch.full((n, -(-k // 128) * 64), 0x5A, dtype=torch.uint8)
    if build.int8_activation_bits():
        wide4 = lambda x: int4_linear(x, codes, s, z, g)  # noqa: E731
        label4 = "int4_linear"
    else:  # no VNNI: today's int4 path is torch's kernel (bf16 activations)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.full((n, k), 5, dtype=torch.int32), 1)
        sz = torch.stack([s, z], dim=2).transpose(0, 1).contiguous().bfloat16()
        wide4 = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, g, sz)  # noqa: E731
        label4 = "torch's _weight_int4pack_mm_for_cpu"
    u8 = torch.full((n, k), 165, dtype=torch.uint8)
    # the q8 group layout's shapes (the values are all alike, so no reordering), for the ops themselves: the
    # caller holds build's lock, which their wrappers would take
    lanes = torch.ops.llminfer_cpu.group_q8_lanes()
    packed8 = u8.reshape(n // lanes, lanes * k)
    codes4 = torch.full((n // lanes, lanes * k // 2), 0x5A, dtype=torch.uint8)
    s_blocked, z_blocked = s.reshape(n // lanes, -1), z.reshape(n // lanes, -1)
    s_half, z_half = s_blocked.bfloat16(), z_blocked.bfloat16()  # int8-wo's layers keep their parameters so
    pairs = {"int8": (lambda x: int8_linear_q8(x, w8, ones), lambda x: int8_linear(x, w8, ones), "int8_linear"),
             # the ops themselves: their wrappers would take build's lock, which the caller holds
             "int8-group": (lambda x: torch.ops.llminfer_cpu.int8_group_linear_q8(x, packed8, s_half, z_half, n),
                            lambda x: torch.ops.llminfer_cpu.int8_group_linear(x, u8, s, z, g), "int8_group_linear"),
             # int4-wo's groups of 32 (the default) take int4_group_linear_q8 on the q8 path
             "int4": (lambda x: torch.ops.llminfer_cpu.int4_group_linear_q8(x, codes4, s_blocked, z_blocked, n),
                      wide4, label4)}
    found: dict[str, dict] = {}
    for kind, (q8, wide, label) in pairs.items():
        q8_ms = wide_ms = 0.0
        for x in xs:
            a, b = _race(lambda: q8(x), lambda: wide(x))  # noqa: B023 - called before x moves on
            q8_ms, wide_ms = q8_ms + a, wide_ms + b
        ratio = Q8_MAX_TIME_RATIO if kind == "int8" else 1.0
        found[kind] = {"path": "q8" if q8_ms <= ratio * wide_ms else "wide", "how": "measured",
                       "q8_ms": round(q8_ms, 4),
                       "wide_ms": round(wide_ms, 4), "wide": label}
    return found


def quant_paths() -> dict[str, dict]:
    """Which path the int8-wo and int4-wo layers take here: ``{"int8": {...}, "int8-group": {...}, "int4":
    {...}}`` (``int8-group``: int8-wo's groups of 32, also int4-wo's int8 LM head), each with ``path``
    (``"q8"``: :func:`int8_linear_q8` / ``int8_group_linear_q8`` / ``int4_group_linear_q8`` (groups of 32, else
    :func:`~llminfer.kernels.q8_linear.int4_linear_q8`); ``"wide"``:
    :func:`int8_linear` / ``int8_group_linear`` / :func:`int4_linear`, or torch's int4 kernel on builds without
    AVX-512 VNNI) and ``how`` (``"forced"`` by
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

    forced = {"int8": _forced_path(INT8_PATH_ENV), "int8-group": _forced_path(INT8_PATH_ENV),
              "int4": _forced_path(INT4_PATH_ENV)}
    if not build._load():
        raise RuntimeError(f"llminfer's CPU kernel is not loaded: {build.unavailable_reason()}")
    with build._lock:
        measured = build._state.get("paths")
        if measured is None and not all(forced.values()):
            cpu = cpu_model()
            path = build._cache_dir(build.target_isa()) / PATHS_FILE
            try:
                kept = json.loads(path.read_text())
                same = (kept.get("cpu") == cpu and kept.get("threads") == torch.get_num_threads()
                        and kept.get("q8_max_time_ratio") == Q8_MAX_TIME_RATIO and set(kept["paths"]) == set(forced))
                measured = kept["paths"] if same else None
            except (OSError, ValueError, KeyError):
                measured = None
            if measured is None:
                with torch.inference_mode():
                    measured = _measure_paths()
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                try:
                    tmp.write_text(json.dumps({"cpu": cpu, "threads": torch.get_num_threads(),
                                               "q8_max_time_ratio": Q8_MAX_TIME_RATIO, "paths": measured}))
                    os.replace(tmp, path)
                except OSError:
                    pass
                log.info("quantized kernel paths measured", **{k: v["path"] for k, v in measured.items()})
            build._state["paths"] = measured
    out: dict[str, dict] = {}
    for kind, force in forced.items():
        out[kind] = {"path": force, "how": "forced"} if force else dict(measured[kind])
    return out


def quant_path_note(kind: str) -> str:
    """One line on the path ``kind`` (``"int8"``, ``"int8-group"`` or ``"int4"``) takes and why, for
    ``llminfer info``: e.g.
    ``"q8 path (vpdpbusd zmm (AVX-512 VNNI), 8-bit activations per 32 columns), measured here: q8 1.75 ms,
    wide 3.49 ms"``.

    Raises:
        ValueError, RuntimeError: as :func:`quant_paths`.
    """
    p = quant_paths()[kind]
    digits = "8-bit activations" if kind == "int8" else "two 8-bit digits"
    what = (f"q8 path ({build.q8_instruction()}, {digits} per 32 columns)" if p["path"] == "q8"
            else "wide path")
    if p["how"] == "forced":
        return f"{what}, forced by {INT4_PATH_ENV if kind == 'int4' else INT8_PATH_ENV}"
    return f"{what}, measured here: q8 {p['q8_ms']:.2f} ms, wide ({p['wide']}) {p['wide_ms']:.2f} ms"
