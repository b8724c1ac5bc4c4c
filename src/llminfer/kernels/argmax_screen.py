"""The exact fp32 argmax of a large LM head at a lower precision's speed: screen, then score the candidates in fp32.

A greedy request that needs no logits (no logprobs, processors, bans or grammar) only needs the head's argmax.
On CPU the fp32 head dominates a small model's decode step (151,646 x 512 is 310 MB to read per step at one
row, 5 GFLOP per step at 32 rows). :class:`ArgmaxScreen` runs such rows through a cheaper copy of the head
(:func:`int8_screen`: a quarter of the bytes, for memory-bound steps of a row; :func:`int8_a8_screen`: the
same copy on 8-bit activations and exact u8 x s8 integer sums, for larger steps on AVX-512 VNNI;
:func:`bf16_screen`: half the bytes, and ``vdpbf16ps`` retires twice the products of an fp32 FMA), bounds the
copy's error per row, keeps every token that could still be the fp32 argmax, and scores only those in fp32
from the fp32 weight (``csrc/screen_candidates.cpp``: one pass per row over the approximate logits).

The bound, for the bf16 copy. For row ``x`` and vocabulary row ``w_j`` let ``s_j = sum_i x_i w_ji`` (exact).
The copy rounds ``x`` and ``w_j`` to bf16 (unit roundoff ``u = 2^-8``), accumulates their exact products in
fp32 and rounds the sum to bf16, so ``|a_j - s_j| <= ((1+u)^3 (1+g) - 1) * sum_i |x_i||w_ji|`` with
``g = n 2^-24 / (1 - n 2^-24)`` the fp32 summation bound for ``n`` terms (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., section 3.1), taken for ``n = 2d``. The fp32 score ``r_j`` is within
``g * sum_i |x_i||w_ji|`` of ``s_j``, and by Cauchy-Schwarz ``sum_i |x_i||w_ji| <= ||x|| * max_j ||w_j||``.
The int8 copy's bound (:func:`int8_screen`) adds the weights' and the activations' rounding instead. With
``E`` the sum of the bounds (raised by a quarter against the rounding of the norms and the threshold), the
fp32 argmax ``j*`` satisfies ``a_j* >= r_j* - E >= r_k - E >= a_k - 2E`` for every ``k``, so
``{j : a_j >= max_k a_k - 2E}`` holds it. Tokens outside that set keep ``a_j``, which is below
``max_k a_k - 2E`` and so below ``r_j*``; the set is scored ``r_j = dot(x, w_j)`` in fp32, each on its own, so
a row's token does not depend on its batch.

Which copy runs where, and whether the screen is kept at all, is measured at load
(:func:`attach_argmax_screen`); the figures are in the README's CPU section.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import structlog
import torch
from torch import nn

log = structlog.get_logger("llminfer.argmax_screen")

__all__ = ["ArgmaxScreen", "ScreenProduct", "attach_argmax_screen", "bf16_screen", "int8_a8_available", "int8_a8_screen",
           "int8_screen", "int8_screens", "screen_margin"]

#: A head smaller than this (elements) is not screened: its fp32 product is already cheap.
MIN_HEAD_ELEMENTS = 8 * 2**20
#: More candidates than this per row (a nearly flat row of logits) and the rows are scored in full instead.
MAX_CANDIDATES_PER_ROW = 4096
#: A copy that fell back to the fp32 head (too many candidates) in more than this share of its first
#: :data:`DROP_AFTER_CALLS` calls or later is dropped (:meth:`ArgmaxScreen._count`).
DROP_FALLBACK_SHARE = 0.125
DROP_AFTER_CALLS = 16
#: The row counts :func:`attach_argmax_screen` times each copy at, with the repetitions (median taken).
PROBES = ((1, 5), (2, 3), (8, 3), (32, 2))
#: Against the rounding of the norms and of the threshold itself, every bound is raised by a quarter.
BOUND_SLACK = 1.25


def _summation_bound(terms: int) -> float:
    unit = terms * 2.0**-24
    return unit / (1.0 - unit)


def screen_margin(in_features: int) -> float:
    """The relative error bound ``c`` (:math:`|a_j - r_j| \\le c\\,\\|x\\|\\max_j\\|w_j\\|`) of a bf16 screen
    against the fp32 score for dot products of ``in_features`` terms (see the module docstring), with the
    summation bound taken for twice the terms (``vdpbf16ps`` adds two products per lane and step) and
    :data:`BOUND_SLACK`."""
    u = 2.0**-8
    g = _summation_bound(2 * in_features)
    return BOUND_SLACK * (((1 + u) ** 3) * (1 + g) - 1 + g)


@attrs.frozen
class ScreenProduct:
    """One approximate product of the head and its error bound.

    Attributes:
        name: ``"bf16"`` or ``"int8"``.
        product: fp32 ``x [R, d]`` -> ``[R, V]`` approximate logits (any float dtype).
        error_bound: fp32 ``x [R, d]`` -> fp32 ``[R, 1]``: for every token ``j``, a bound on the distance
            between the approximate logit and the fp32 score ``dot(x, w_j)``.
        bytes: what the copy holds.
    """

    name: str
    product: Callable[[torch.Tensor], torch.Tensor]
    error_bound: Callable[[torch.Tensor], torch.Tensor]
    bytes: int


def bf16_screen(weight: torch.Tensor) -> ScreenProduct:
    """oneDNN's packed bf16 copy of ``weight`` (fp32 ``[V, d]``): ``V * d * 2`` bytes. Its bound is
    :func:`screen_margin` times ``||x|| * max_j ||w_j||``. Raises RuntimeError where oneDNN has no bf16 kernel."""
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), None)
        wmax = float(weight.norm(dim=1).max())
    margin = screen_margin(weight.shape[1]) * wmax
    tiny = weight.shape[1] * 2.0**-100  # denormals that vdpbf16ps counts as zero

    def product(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")

    def error_bound(x: torch.Tensor) -> torch.Tensor:
        return x.norm(dim=1, keepdim=True) * margin + tiny

    return ScreenProduct("bf16", product, error_bound, packed.numel() * 2)


@attrs.frozen
class _Int8Copy:
    """A per-row symmetric int8 copy of an fp32 head and the constants of its error bounds."""

    codes: torch.Tensor  # int8 [V, d]
    scale: torch.Tensor  # fp32 [V]
    max_scale: float     # max_j s_j
    code_mass: float     # max_j s_j ||q_j||_1
    wmax: float          # max_j ||w_j||, raised by 2^-7 against its own rounding

    @classmethod
    def of(cls, weight: torch.Tensor) -> _Int8Copy:
        with torch.no_grad():
            scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
            codes = torch.round(weight / scale[:, None]).clamp_(-127, 127)
            code_mass = float((codes.abs().sum(dim=1) * scale).max())
            return cls(codes.to(torch.int8).contiguous(), scale, float(scale.max()), code_mass,
                       float(weight.norm(dim=1).max()) * (1 + 2.0**-7))

    def error_bound(self, x: torch.Tensor, activation_steps: float, terms: int) -> torch.Tensor:
        """The bound for rows ``x`` where each activation row is rounded to ``max|x| / activation_steps``
        steps (``inf``: not rounded), with fp32 sums of ``terms`` terms in the copy and the score."""
        ax = x.abs()
        g = 2 * _summation_bound(terms)
        return BOUND_SLACK * (ax.sum(dim=1, keepdim=True) * (self.max_scale / 2)
                              + ax.amax(dim=1, keepdim=True) * (self.code_mass / (2 * activation_steps))
                              + x.norm(dim=1, keepdim=True) * (g * self.wmax))

    def bytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4


def int8_screen(weight: torch.Tensor, copy: _Int8Copy | None = None) -> ScreenProduct:
    """A per-row symmetric int8 copy of ``weight`` (fp32 ``[V, d]``, ``d % 32 == 0``) on llminfer's
    :func:`~llminfer.kernels.linear.int8_linear` (``V * d`` bytes plus a scale per row).

    Its bound for row ``x``: the weights' rounding (``|w - s q| <= s / 2``) costs at most
    ``max_j s_j / 2 * ||x||_1``; the activations' rounding (14 bits per row on VNNI, none elsewhere) at most
    ``max_j s_j ||q_j||_1 * ||x||_inf / 16382``; the fp32 sums and the fp32 score at most
    ``2 g(2d) * ||x|| * max_j ||w_j||``; all times :data:`BOUND_SLACK`.
    Raises RuntimeError where the kernel is not loaded.
    """
    from llminfer.kernels.linear import int8_linear

    c = copy or _Int8Copy.of(weight)
    terms = 2 * weight.shape[1]

    def product(x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x.contiguous(), c.codes, c.scale)

    return ScreenProduct("int8", product, lambda x: c.error_bound(x, 8191.0, terms), c.bytes())


def int8_a8_available(in_features: int) -> bool:
    """Whether :func:`int8_a8_screen` runs here: the kernels' AVX-512 VNNI build and ``in_features % 64 == 0``
    (up to 65536)."""
    from llminfer.kernels.build import skinny_linear_available

    if in_features % 64 or in_features > 65536 or not skinny_linear_available():
        return False
    return "zmm" in torch.ops.llminfer_cpu.q8_instruction()


def int8_a8_screen(weight: torch.Tensor, copy: _Int8Copy | None = None) -> ScreenProduct:
    """The int8 copy of :func:`int8_screen` on 8-bit activations: ``torch.ops.llminfer_cpu.int8_linear_a8``
    (``csrc/int8_linear_a8.cpp``; AVX-512 VNNI, ``d % 64 == 0``) rounds each activation row to
    ``max|x| / 127`` steps and sums u8 x s8 products exactly in int32 (``vpdpbusd``, 64 a instruction, the
    row's activations held in registers), about twice the products per instruction of the 14-bit path and
    no widening of the weights. Its bound is :func:`int8_screen`'s with ``||x||_inf / 254`` in place of
    ``/ 16382``. Raises RuntimeError where the kernel cannot run it (:func:`int8_a8_available`).
    """
    if not int8_a8_available(weight.shape[1]):
        raise RuntimeError("int8_linear_a8 needs the AVX-512 VNNI kernel build and in_features % 64 == 0")
    c = copy or _Int8Copy.of(weight)
    sums = c.codes.sum(dim=1, dtype=torch.int32)
    op = torch.ops.llminfer_cpu.int8_linear_a8
    terms = 2 * weight.shape[1]

    def product(x: torch.Tensor) -> torch.Tensor:
        return op(x.contiguous(), c.codes, c.scale, sums)

    return ScreenProduct("int8-a8", product, lambda x: c.error_bound(x, 127.0, terms), c.bytes() + sums.numel() * 4)


def int8_screens(weight: torch.Tensor) -> list[ScreenProduct]:
    """:func:`int8_screen` and, where it runs, :func:`int8_a8_screen`, sharing one int8 copy."""
    c = _Int8Copy.of(weight)
    products = [int8_screen(weight, c)]
    if int8_a8_available(weight.shape[1]):
        products.append(int8_a8_screen(weight, c))
    return products


class ArgmaxScreen:
    """Approximate copies of an fp32 head ``weight`` (``[V, d]``, no bias) that find each row's fp32 argmax.

    Args:
        weight: the fp32 head weight ``[V, d]``, contiguous, on CPU (kept by reference for the fp32 scores).
        products: ``(max_rows, product)`` pairs, by increasing ``max_rows``: a call of ``R`` rows takes the
            first whose ``max_rows >= R``, else the last (built by :func:`attach_argmax_screen`).
    """

    def __init__(self, weight: torch.Tensor, products: Sequence[tuple[int, ScreenProduct]]) -> None:
        self.weight = weight
        self.products = list(products)
        self.version = (weight._version, weight.data_ptr())
        self.rows_screened = 0
        self.candidates = 0
        self.calls: dict[str, int] = {}
        self.fallbacks: dict[str, int] = {}
        self.dropped: list[str] = []
        from llminfer.kernels.build import skinny_linear_available

        # candidates found and scored in one C++ pass where the kernels are loaded (else numpy and torch)
        self._fused = weight.shape[1] % 8 == 0 and skinny_linear_available()

    @property
    def stale(self) -> bool:
        """Whether the fp32 weight was modified in place or replaced since the copies were made (then do not use
        them). An in-place edit through ``weight.data`` moves neither and is not seen, as for oneDNN's packed
        copy (:class:`~llminfer.kernels.prepack.PrepackedLinear`)."""
        return (self.weight._version, self.weight.data_ptr()) != self.version

    @property
    def active(self) -> bool:
        """Whether any copy is left (:meth:`logits` drops one whose bound keeps too many candidates)."""
        return bool(self.products)

    def product_for(self, rows: int) -> ScreenProduct:
        """The copy a product of ``rows`` rows runs on."""
        return next((p for limit, p in self.products if rows <= limit), self.products[-1][1])

    def _count(self, product: ScreenProduct, fell_back: bool) -> None:
        """Drop a copy whose bound proves too loose on the real hidden states (the load-time probe used random
        ones): after :data:`DROP_AFTER_CALLS` calls, one that fell back to the fp32 head in more than
        :data:`DROP_FALLBACK_SHARE` of them. Its step sizes go to the next copy, or the screen ends."""
        name = product.name
        self.calls[name] = self.calls.get(name, 0) + 1
        self.fallbacks[name] = self.fallbacks.get(name, 0) + fell_back
        if self.calls[name] >= DROP_AFTER_CALLS and self.fallbacks[name] > DROP_FALLBACK_SHARE * self.calls[name]:
            limits = [limit for limit, p in self.products if p is not product]
            kept = [p for _, p in self.products if p is not product]
            self.products = list(zip(limits[:-1] + [2**31], kept)) if kept else []
            self.dropped.append(name)
            log.info("argmax screen copy dropped: its bound keeps too many candidates", copy=name,
                     calls=self.calls[name], fallbacks=self.fallbacks[name])

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits whose argmax is each row's fp32 argmax: the fp32 score at each candidate, the screen's value
        (strictly below the best candidate's score) elsewhere. Only their argmax means anything.

        Args:
            x: ``[R, d]`` float32 hidden states on CPU.

        Returns:
            ``[R, V]`` float32, or None where the screen cannot decide cheaply (a non-finite row, more than
            :data:`MAX_CANDIDATES_PER_ROW` candidates in a row): then the caller runs the fp32 head.
        """
        if not self.products:
            return None
        vocab = self.weight.shape[0]
        chosen = self.product_for(x.shape[0])
        screen = chosen.product(x).float()  # [R, V]; a fresh tensor (bf16 -> fp32, or int8's own output)
        threshold = screen.amax(dim=1, keepdim=True) - 2.0 * chosen.error_bound(x)
        if not bool(torch.isfinite(threshold).all()):
            return None
        if self._fused:
            # one pass per row in C++ (csrc/screen_candidates.cpp): compare, and score each candidate in place
            found = torch.ops.llminfer_cpu.screen_candidates(screen, threshold.view(-1).contiguous(), self.weight,
                                                             x.contiguous(), MAX_CANDIDATES_PER_ROW)
            self._count(chosen, found < 0)
            if found < 0:
                return None
        else:
            flat = np.flatnonzero(screen.numpy() >= threshold.numpy())  # SIMD compare and scan, few hits
            too_many = len(flat) > MAX_CANDIDATES_PER_ROW * x.shape[0]
            self._count(chosen, too_many)
            if too_many:
                return None
            index = torch.from_numpy(flat)
            rows, cols = index // vocab, index % vocab
            scores = (self.weight.index_select(0, cols) * x.index_select(0, rows)).sum(dim=1)
            screen.view(-1)[index] = scores
            found = len(flat)
        # The other tokens keep their screen values: each is below max a - 2E, and the best candidate's score
        # is at least max a - E, so none of them can be the argmax (and no [R, V] fill is needed).
        self.rows_screened += x.shape[0]
        self.candidates += found
        return screen

    def describe(self) -> dict[str, Any]:
        """The copies (``[max_rows, name]`` in order), those dropped, calls and fallbacks per copy, rows screened so
        far and their mean fp32-scored candidates."""
        return {"products": [[limit, p.name] for limit, p in self.products], "dropped": self.dropped,
                "calls": self.calls, "fallbacks": self.fallbacks, "rows": self.rows_screened,
                "candidates_per_row": round(self.candidates / self.rows_screened, 1) if self.rows_screened else 0}


def _median_ms(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e3


def attach_argmax_screen(head: nn.Module, *, min_elements: int = MIN_HEAD_ELEMENTS, require_faster: bool = True) -> bool:
    """Give ``head`` (a :class:`~llminfer.kernels.prepack.PrepackedLinear` over an fp32 weight, no bias, at
    least ``min_elements`` elements) an :class:`ArgmaxScreen` where that is faster, choosing its copies by
    measurement.

    The candidates: :func:`bf16_screen` where oneDNN has native bf16 and the kernels are not forced to AVX2
    (``LLMINFER_CPU_KERNEL_ISA=avx2`` stands for CPUs without AVX-512 BF16), and :func:`int8_screen` where
    llminfer's kernels are loaded and ``d % 32 == 0``. At each of :data:`PROBES`' row counts the fp32 head and
    each copy's screen are timed (about a second at load for a 151k x 512 head); the faster copy takes the
    steps up to that count (the last one's, all larger steps). The screen is kept when its 1-row time is
    under 90 % of the fp32 head's (``require_faster=False`` keeps it regardless).

    Returns:
        Whether the screen was attached (``head.argmax_screen``; ``head.argmax_screen_probe_ms`` holds the
        probe). Raises nothing: a failure keeps the fp32 head.
    """
    from llminfer.kernels.build import skinny_linear_available, target_isa
    from llminfer.kernels.cpu_info import cpu_flags
    from llminfer.kernels.prepack import PrepackedLinear, prepack_supported

    weight = getattr(head, "weight", None)
    if (not isinstance(head, PrepackedLinear) or head.bias is not None or weight is None
            or weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous()
            or weight.numel() < min_elements):
        return False
    builders: list[Callable[[torch.Tensor], list[ScreenProduct]]] = []
    if (target_isa() != "avx2" and "avx512_bf16" in cpu_flags()
            and prepack_supported(torch.bfloat16, weight.device)):
        builders.append(lambda w: [bf16_screen(w)])
    if weight.shape[1] % 32 == 0 and skinny_linear_available():
        builders.append(int8_screens)
    products: list[ScreenProduct] = []
    probe: dict[str, float] = {}
    try:
        with torch.no_grad():  # not inference mode: the fp32 weight's version counter is read
            for build in builders:
                with contextlib.suppress(RuntimeError):  # an oneDNN build without bf16, a kernel without int8
                    products.extend(build(weight))
        if not products:
            return False
        with torch.inference_mode():
            for rows, reps in PROBES:
                x = torch.randn(rows, weight.shape[1])
                probe[f"fp32_{rows}"] = _median_ms(lambda x=x: head(x), reps)
                for p in products:
                    probe[f"{p.name}_{rows}"] = _median_ms(lambda x=x, p=p: ArgmaxScreen(weight, [(0, p)]).logits(x),
                                                           reps)
    except RuntimeError as exc:
        log.warning("argmax screen unavailable; using the fp32 head", error=str(exc)[:200])
        return False
    chosen: list[tuple[int, ScreenProduct]] = []
    for rows, _ in PROBES:  # the fastest copy at each probed size takes the steps up to that size
        best = min(products, key=lambda p, rows=rows: probe[f"{p.name}_{rows}"])
        if chosen and chosen[-1][1] is best:
            chosen.pop()
        chosen.append((rows, best))
    chosen[-1] = (2**31, chosen[-1][1])
    keep = probe[f"{chosen[0][1].name}_1"] < 0.9 * probe["fp32_1"] or not require_faster
    probe = {k: round(v, 2) for k, v in probe.items()}
    log.debug("argmax screen measured", kept=keep, **probe)
    head.argmax_screen = ArgmaxScreen(weight, chosen) if keep else None
    head.argmax_screen_probe_ms = probe
    return keep
