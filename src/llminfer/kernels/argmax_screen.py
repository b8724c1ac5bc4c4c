"""The exact argmax of a large LM head (fp32 or bf16) at a lower precision's speed: screen, then score the candidates.

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
The int8 copy's bound (:func:`int8_screen`) adds the weights' and the activations' rounding instead; the weights'
part is token ``j``'s own, ``s_j / 2 * ||x||_1`` for its row's step ``s_j`` (a trained head's steps differ by
3x and more from row to row; see :meth:`ArgmaxScreen.logits` for the threshold it gives). With
``E`` the sum of the bounds (raised by a quarter against the rounding of the norms and the threshold), the
fp32 argmax ``j*`` satisfies ``a_j* >= r_j* - E >= r_k - E >= a_k - 2E`` for every ``k``, so
``{j : a_j >= max_k a_k - 2E}`` holds it. Tokens outside that set keep ``a_j``, which is below
``max_k a_k - 2E`` and so below ``r_j*``; the set is scored ``r_j = dot(x, w_j)`` in fp32, each on its own, so
a row's token does not depend on its batch.

A bf16 head (``dtype=bfloat16``) is screened the same way through the int8 copy of its weight, for steps the
head would run on llminfer's :func:`~llminfer.kernels.bf16_linear.bf16_linear` (up to
:attr:`~llminfer.kernels.prepack.PrepackedLinear.kernel_rows` rows). Its candidates are scored by that kernel on
their own rows of the weight, which gives each the bits of the full product (the kernel's order per output does
not depend on the other outputs), so a screened step's tokens are the unscreened step's. The bound then also
covers the flush of denormal products, and the line moves down by the bf16 rounding of the top score
(``2u(1+u)`` of its size, ``u = 2^-8``): rounding keeps the order of the fp32 sums but ties sums that share a
bf16 value, and of those the lowest index is the argmax.

Which copy runs where, and whether the screen is kept at all, is measured at load
(:func:`attach_argmax_screen`); the figures are in the README's CPU section.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import structlog
import torch
from torch import nn

from llminfer.kernels.screen_copies import (
    BOUND_SLACK,
    ScreenProduct,
    bf16_screen,
    int8_a8_available,
    int8_a8_screen,
    int8_screen,
    int8_screens,
    screen_margin,
)

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


class ArgmaxScreen:
    """Approximate copies of a head ``weight`` (``[V, d]``, no bias) that find each row's argmax.

    Args:
        weight: the head weight ``[V, d]``, contiguous, on CPU (kept by reference for the scores): fp32 (scored
            in fp32), or bf16 (scored by :func:`~llminfer.kernels.bf16_linear.bf16_linear`; the products' bounds
            must cover that score, as :func:`int8_screens` builds them).
        products: ``(max_rows, product)`` pairs, by increasing ``max_rows``: a call of ``R`` rows takes the
            first whose ``max_rows >= R``, else the last (built by :func:`attach_argmax_screen`).
        max_step_rows: the most rows of a step the screen may take (the head runs larger steps in full; for a
            bf16 head, the rows its own kernel takes); None for any.
        spares: copies to take every step, in order, once all of ``products`` are dropped (:meth:`_count`).
    """

    def __init__(self, weight: torch.Tensor, products: Sequence[tuple[int, ScreenProduct]],
                 max_step_rows: int | None = None, spares: Sequence[ScreenProduct] = ()) -> None:
        self.weight = weight
        self.max_step_rows = max_step_rows
        self.spares = list(spares)
        self.products = list(products)
        self.version = (weight._version, weight.data_ptr())
        self.rows_screened = 0
        self.candidates = 0
        self.calls: dict[str, int] = {}
        self.fallbacks: dict[str, int] = {}
        self.dropped: list[str] = []
        from llminfer.kernels.build import skinny_linear_available

        # fp32: candidates found and scored in one C++ pass where the kernels are loaded (else numpy and torch)
        self._fused = weight.dtype == torch.float32 and weight.shape[1] % 8 == 0 and skinny_linear_available()

    def reset_counts(self) -> None:
        """Forget the rows screened, the candidates and the calls and fallbacks per copy (not the copies
        dropped)."""
        self.rows_screened = self.candidates = 0
        self.calls, self.fallbacks = {}, {}

    @property
    def stale(self) -> bool:
        """Whether the weight was modified in place or replaced since the copies were made (then do not use
        them). An in-place edit through ``weight.data`` moves neither and is not seen: the copies then keep the
        old values, as oneDNN's packed copy does (:class:`~llminfer.kernels.prepack.PrepackedLinear`), while the
        steps that read the plain weight (up to ``kernel_rows`` rows) see the new ones."""
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
        ones): after :data:`DROP_AFTER_CALLS` calls, one that fell back to the full head in more than
        :data:`DROP_FALLBACK_SHARE` of them. Its step sizes go to the next copy, else to the first spare, or the
        screen ends."""
        name = product.name
        self.calls[name] = self.calls.get(name, 0) + 1
        self.fallbacks[name] = self.fallbacks.get(name, 0) + fell_back
        if self.calls[name] >= DROP_AFTER_CALLS and self.fallbacks[name] > DROP_FALLBACK_SHARE * self.calls[name]:
            limits = [limit for limit, p in self.products if p is not product]
            kept = [p for _, p in self.products if p is not product]
            if not kept and self.spares:
                kept, limits = [self.spares.pop(0)], [2**31]
            self.products = list(zip(limits[:-1] + [2**31], kept)) if kept else []
            self.dropped.append(name)
            log.info("argmax screen copy dropped: its bound keeps too many candidates", copy=name,
                     calls=self.calls[name], fallbacks=self.fallbacks[name])

    def takes(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows may be screened: a copy is left, the weight is not stale, and
        ``rows`` is within :attr:`max_step_rows`."""
        return bool(self.products) and not self.stale and (self.max_step_rows is None or rows <= self.max_step_rows)

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits whose argmax is each row's argmax through the head: the head's score at each candidate
        (fp32; a bf16 head's bf16 score, widened), the screen's value (strictly below the best candidate's
        score) elsewhere. Only their argmax means anything.

        Args:
            x: ``[R, d]`` hidden states on CPU, of the weight's dtype.

        Returns:
            ``[R, V]`` float32, or None where the screen cannot decide cheaply (a non-finite row, more than
            :data:`MAX_CANDIDATES_PER_ROW` candidates in a row): then the caller runs the full head.
        """
        if not self.products:
            return None
        vocab = self.weight.shape[0]
        chosen = self.product_for(x.shape[0])
        xf = x.float()
        screen = chosen.product(xf).float()  # [R, V]; a fresh tensor (bf16 -> fp32, or int8's own output)
        bound = chosen.error_bound(xf)
        if chosen.token_scale is None:
            top_value = screen.amax(dim=1, keepdim=True)
            threshold = top_value - 2.0 * bound
            largest = top_value.abs() + bound  # bounds |t| for the top fp32 sum t
        else:
            # Token j's bound is E_j = bound + alpha s_j. The argmax j* has a_j* + E_j* >= r_j* >= max_k (a_k - E_k),
            # so every token with a_j + alpha s_j >= max_k (a_k - alpha s_k) - 2 bound is kept; the others keep
            # a_j + alpha s_j, still below that line, so below r_j*. (amax, not argmax: torch's argmax is not
            # vectorized on CPU, 128 against 9 us over 151,646 logits.)
            alpha = chosen.token_bound(xf)
            scale = chosen.token_scale.view(1, -1)
            lower = torch.addcmul(screen, alpha, scale, value=-1.0).amax(dim=1, keepdim=True)
            threshold = lower - 2.0 * bound
            largest = None
            if chosen.score_rounding:  # |t_top| <= max a + alpha max_j s_j + bound, and lower is within that too
                largest = screen.amax(dim=1, keepdim=True).abs() + alpha * chosen.max_token_scale + bound
            screen.addcmul_(alpha, scale)
        if chosen.score_rounding:
            # Rounding keeps the order of the fp32 sums t, but ties the top sum with every sum in its bucket, and
            # the lowest index of those wins: keep all tokens within 2u(1+u)|t_top| of the line as well.
            u = chosen.score_rounding
            threshold = threshold - (BOUND_SLACK * 2 * u * (1 + u)) * largest
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
            if self.weight.dtype == torch.bfloat16:
                scores = self._bf16_scores(x, rows, cols)
            else:
                scores = (self.weight.index_select(0, cols) * x.index_select(0, rows)).sum(dim=1)
            screen.view(-1)[index] = scores
            found = len(flat)
        # The other tokens keep their screen values (raised by alpha s_j with per-token bounds): each is below the
        # threshold, which is below the best candidate's score, so none of them can be the argmax (and no [R, V]
        # fill is needed).
        self.rows_screened += x.shape[0]
        self.candidates += found
        return screen

    def _bf16_scores(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The bf16 head's logits at ``(rows, cols)`` (row-major order), widened to fp32: each row's candidates
        through :func:`~llminfer.kernels.bf16_linear.bf16_linear` on their rows of the weight."""
        from llminfer.kernels.bf16_linear import bf16_linear

        out, start = [], 0
        for r, n in zip(*(t.tolist() for t in torch.unique_consecutive(rows, return_counts=True))):
            out.append(bf16_linear(x[r:r + 1].contiguous(), self.weight.index_select(0, cols[start:start + n]))[0])
            start += n
        return torch.cat(out).float() if out else torch.empty(0)

    def describe(self) -> dict[str, Any]:
        """The copies (``[max_rows, name]`` in order), the spares, those dropped, calls and fallbacks per copy, rows screened so
        far and their mean fp32-scored candidates."""
        return {"products": [[limit, p.name] for limit, p in self.products], "spares": [p.name for p in self.spares],
                "dropped": self.dropped,
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
    """Give ``head`` (a :class:`~llminfer.kernels.prepack.PrepackedLinear` over an fp32 weight, or a bf16 one
    whose small steps run on llminfer's bf16 kernel (``kernel_rows > 0``), no bias, at least ``min_elements``
    elements) an :class:`ArgmaxScreen` where that is faster, choosing its copies by measurement.

    The candidates: :func:`bf16_screen` where oneDNN has native bf16 and the kernels are not forced to AVX2
    (``LLMINFER_CPU_KERNEL_ISA=avx2`` stands for CPUs without AVX-512 BF16), and :func:`int8_screen` where
    llminfer's kernels are loaded and ``d % 32 == 0``. At each of :data:`PROBES`' row counts the head and
    each copy's screen are timed (about a second at load for a 151k x 512 head); the faster copy takes the
    steps up to that count (the last one's, all larger steps). The screen is kept when its 1-row time is
    under 90 % of the head's own (``require_faster=False`` keeps it regardless). A bf16 head takes only the int8
    copies, timed and used at the row counts up to its ``kernel_rows``.

    Returns:
        Whether the screen was attached (``head.argmax_screen``; ``head.argmax_screen_probe_ms`` holds the
        probe). Raises nothing: a failure keeps the full head.
    """
    from llminfer.kernels.build import bf16_kernel_available, skinny_linear_available, target_isa
    from llminfer.kernels.cpu_info import cpu_flags
    from llminfer.kernels.prepack import PrepackedLinear, prepack_supported

    weight = getattr(head, "weight", None)
    if (not isinstance(head, PrepackedLinear) or head.bias is not None or weight is None
            or weight.device.type != "cpu" or not weight.is_contiguous() or weight.numel() < min_elements):
        return False
    bf16_head = weight.dtype == torch.bfloat16
    if not (weight.dtype == torch.float32 or (bf16_head and head.kernel_rows > 0 and bf16_kernel_available())):
        return False
    max_step_rows = head.kernel_rows if bf16_head else None
    probes = [(rows, reps) for rows, reps in PROBES if max_step_rows is None or rows <= max_step_rows]
    head_name = "bf16" if bf16_head else "fp32"
    builders: list[Callable[[torch.Tensor], list[ScreenProduct]]] = []
    if (not bf16_head and target_isa() != "avx2" and "avx512_bf16" in cpu_flags()
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
            for rows, reps in probes:
                x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
                probe[f"{head_name}_{rows}"] = _median_ms(lambda x=x: head(x), reps)
                for p in products:
                    probe[f"{p.name}_{rows}"] = _median_ms(lambda x=x, p=p: ArgmaxScreen(weight, [(0, p)]).logits(x),
                                                           reps)
    except RuntimeError as exc:
        log.warning("argmax screen unavailable; using the full head", error=str(exc)[:200])
        return False
    chosen: list[tuple[int, ScreenProduct]] = []
    for rows, _ in probes:  # the fastest copy at each probed size takes the steps up to that size
        best = min(products, key=lambda p, rows=rows: probe[f"{p.name}_{rows}"])
        if chosen and chosen[-1][1] is best:
            chosen.pop()
        chosen.append((rows, best))
    chosen[-1] = (2**31, chosen[-1][1])
    keep = probe[f"{chosen[0][1].name}_1"] < 0.9 * probe[f"{head_name}_1"] or not require_faster
    probe = {k: round(v, 2) for k, v in probe.items()}
    log.debug("argmax screen measured", kept=keep, **probe)
    # spares: the unchosen copies that hold no bytes of their own (the int8 copy the chosen one shares), so a
    # spare costs no memory; a bf16 copy the probe did not choose is freed
    held = [c.storage for _, c in chosen if c.storage is not None]
    spares = sorted((p for p in products if all(p is not c for _, c in chosen) and any(p.storage is h for h in held)),
                    key=lambda p: probe[f"{p.name}_1"])
    head.argmax_screen = ArgmaxScreen(weight, chosen, max_step_rows, spares) if keep else None
    head.argmax_screen_probe_ms = probe
    return keep
