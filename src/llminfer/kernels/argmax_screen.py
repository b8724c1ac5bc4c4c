"""The exact fp32 argmax of a large LM head at bf16 speed: screen in bf16, score the candidates in fp32.

A greedy request that needs no logits (no logprobs, processors, bans or grammar) only needs the head's argmax.
On CPU the fp32 head dominates a small model's decode step (151,646 x 512 is 310 MB to read per step at one
row, 5 GFLOP per step at 32 rows). :class:`ArgmaxScreen` runs such rows through a bf16 copy of the head
(half the bytes; ``vdpbf16ps`` retires twice the products of an fp32 FMA), bounds the screen's error per row,
keeps every token that could still be the fp32 argmax, and scores only those in fp32 from the fp32 weight.

The bound. For row ``x`` and vocabulary row ``w_j`` let ``s_j = sum_i x_i w_ji`` (exact). The screen rounds
``x`` and ``w_j`` to bf16 (unit roundoff ``u = 2^-8``), accumulates their exact products in fp32 and rounds
the sum to bf16, so ``|a_j - s_j| <= ((1+u)^3 (1+g) - 1) * sum_i |x_i||w_ji|`` with ``g = n 2^-24 / (1 - n
2^-24)`` the fp32 summation bound for ``n`` terms (Higham, *Accuracy and Stability of Numerical Algorithms*,
2nd ed., section 3.1), taken for ``n = 2d``. The fp32 score ``r_j`` is within ``g * sum_i |x_i||w_ji|`` of ``s_j``, and by
Cauchy-Schwarz ``sum_i |x_i||w_ji| <= ||x|| * max_j ||w_j||``. With ``E`` the sum of both bounds (raised
by a quarter against the rounding of the norms and the threshold, plus an absolute term for the denormals
that ``vdpbf16ps`` treats as zero), the fp32 argmax ``j*`` satisfies ``a_j* >= r_j* - E >= r_k - E >= a_k - 2E`` for every
``k``, so ``{j : a_j >= max_k a_k - 2E}`` holds it. Tokens outside that set keep ``a_j``, which is below
``max_k a_k - 2E`` and so below ``r_j*``; the set is scored ``r_j = dot(x, w_j)`` in fp32, each on its own, so a row's token does not depend on its batch.

The screen is kept only where a short measurement at load shows it faster than the fp32 head
(:func:`attach_argmax_screen`); its figures are in the README's CPU section.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import structlog
import torch
from torch import nn

log = structlog.get_logger("llminfer.argmax_screen")

__all__ = ["ArgmaxScreen", "attach_argmax_screen", "screen_margin"]

#: A head smaller than this (elements) is not screened: its fp32 product is already cheap.
MIN_HEAD_ELEMENTS = 8 * 2**20
#: More candidates than this per row (a nearly flat row of logits) and the rows are scored in full instead.
MAX_CANDIDATES_PER_ROW = 4096


def screen_margin(in_features: int) -> float:
    """The relative error bound ``c`` (:math:`|a_j - r_j| \\le c\\,\\|x\\|\\max_j\\|w_j\\|`) of a bf16 screen
    against the fp32 score for dot products of ``in_features`` terms (see the module docstring), with the
    summation bound taken for twice the terms (``vdpbf16ps`` adds two products per lane and step) and a
    quarter more against the rounding of the norms and of the threshold itself."""
    u = 2.0**-8
    unit = 2 * in_features * 2.0**-24
    g = unit / (1.0 - unit)
    return 1.25 * (((1 + u) ** 3) * (1 + g) - 1 + g)


class ArgmaxScreen:
    """A bf16 copy of an fp32 head ``weight`` (``[V, d]``, no bias) that finds each row's fp32 argmax.

    Args:
        weight: the fp32 head weight ``[V, d]``, contiguous, on CPU (kept by reference for the fp32 scores).
        bf16_head: ``x_bf16 [R, d] -> [R, V]`` bf16, the product with the bf16 copy (built by
            :func:`attach_argmax_screen`).

    The copy costs ``V * d * 2`` bytes (155 MB for 151,646 x 512), in oneDNN's packed layout.
    """

    def __init__(self, weight: torch.Tensor, bf16_head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.weight = weight
        self.bf16_head = bf16_head
        self.version = weight._version
        with torch.no_grad():
            self.max_row_norm = float(weight.norm(dim=1).max())
        self.margin = screen_margin(weight.shape[1])
        self.rows_screened = 0
        self.candidates = 0

    @property
    def stale(self) -> bool:
        """Whether the fp32 weight was modified in place since the copy was made (then do not use it)."""
        return self.weight._version != self.version

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits whose argmax is each row's fp32 argmax: the fp32 score at each candidate, the screen's value
        (strictly below the best candidate's score) elsewhere. Only their argmax means anything.

        Args:
            x: ``[R, d]`` float32 hidden states on CPU.

        Returns:
            ``[R, V]`` float32, or None where the screen cannot decide cheaply (a non-finite row, more than
            :data:`MAX_CANDIDATES_PER_ROW` candidates in a row): then the caller runs the fp32 head.
        """
        vocab = self.weight.shape[0]
        screen = self.bf16_head(x.to(torch.bfloat16)).float()  # [R, V]
        norms = x.norm(dim=1, keepdim=True)
        threshold = screen.amax(dim=1, keepdim=True) - 2.0 * (self.margin * self.max_row_norm * norms
                                                              + x.shape[1] * 2.0**-100)
        if not bool(torch.isfinite(threshold).all()):
            return None
        flat = np.flatnonzero(screen.numpy() >= threshold.numpy())  # SIMD compare and scan, few hits
        if len(flat) > MAX_CANDIDATES_PER_ROW * x.shape[0]:
            return None
        index = torch.from_numpy(flat)
        rows, cols = index // vocab, index % vocab
        scores = (self.weight.index_select(0, cols) * x.index_select(0, rows)).sum(dim=1)
        # The other tokens keep their screen values: each is below max a - 2E, and the best candidate's score
        # is at least max a - E, so none of them can be the argmax (and no [R, V] fill is needed).
        screen.view(-1)[index] = scores
        self.rows_screened += x.shape[0]
        self.candidates += len(flat)
        return screen

    def describe(self) -> dict[str, float | int]:
        """Rows screened so far and their mean number of fp32-scored candidates."""
        return {"rows": self.rows_screened,
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
    """Give ``head`` (a :class:`~llminfer.kernels.prepack.PrepackedLinear` over an fp32 weight, no bias) an
    :class:`ArgmaxScreen` where that is faster: on CPU with native bf16 in oneDNN, outside a forced AVX2 build
    (``LLMINFER_CPU_KERNEL_ISA=avx2`` stands for CPUs without it), for heads of at least
    ``min_elements`` (:data:`MIN_HEAD_ELEMENTS`), and when one row through the screen takes under 90 % of the
    fp32 head's time (median of 5 each, about 0.1 s at load; ``require_faster=False`` skips that condition).

    Returns:
        Whether the screen was attached (``head.argmax_screen``). Raises nothing: a failure keeps the fp32 head.
    """
    from llminfer.kernels.build import target_isa
    from llminfer.kernels.prepack import PrepackedLinear, prepack_supported

    weight = getattr(head, "weight", None)
    if (not isinstance(head, PrepackedLinear) or head.bias is not None or weight is None
            or weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous()
            or weight.numel() < min_elements or target_isa() == "avx2"
            or not prepack_supported(torch.bfloat16, weight.device)):
        return False
    try:
        with torch.no_grad():  # not inference mode: the fp32 weight's version counter is read
            # oneDNN's packed bf16 product at every row count: on Zen 4 it beat llminfer's bf16 kernel from 2
            # rows on and tied at 1 (bench/bench_cpu_kernels.py), and only the packed copy is then kept.
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), None)

            def bf16_head(x: torch.Tensor) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

            screen = ArgmaxScreen(weight, bf16_head)
        with torch.inference_mode():
            probe = torch.randn(1, weight.shape[1])
            full_ms = _median_ms(lambda: head(probe))
            screened_ms = _median_ms(lambda: screen.logits(probe))
        screen.rows_screened = screen.candidates = 0
    except RuntimeError as exc:  # an oneDNN build without the bf16 kernel
        log.warning("argmax screen unavailable; using the fp32 head", error=str(exc)[:200])
        return False
    keep = screened_ms < 0.9 * full_ms or not require_faster
    log.debug("argmax screen measured", fp32_ms=round(full_ms, 2), screened_ms=round(screened_ms, 2), kept=keep)
    head.argmax_screen = screen if keep else None
    head.argmax_screen_probe_ms = {"fp32": round(full_ms, 2), "screened": round(screened_ms, 2)}
    return keep
