"""The approximate copies of an LM head that :mod:`llminfer.kernels.argmax_screen` screens through, each with
the bound of its error against the head's own score (the proofs: that module's docstring).

* :func:`bf16_screen`: oneDNN's packed bf16 copy of an fp32 head;
* :func:`int8_screen`: a per-row symmetric int8 copy on llminfer's ``int8_linear`` (14-bit activations on VNNI);
* :func:`int8_a8_screen`: the same copy on 8-bit activations (``int8_linear_a8``, AVX-512 VNNI).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

__all__ = ["BOUND_SLACK", "ScreenProduct", "bf16_screen", "int8_a8_available", "int8_a8_screen", "int8_screen",
           "int8_screens", "screen_margin"]

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
            between the approximate logit and the head's score of ``j`` (with ``token_scale``: the part of
            that bound that is the same for every token).
        bytes: what the copy holds.
        token_scale: fp32 ``[V]`` or None: with ``token_bound``, the bound of token ``j`` is
            ``error_bound(x) + token_bound(x) * token_scale[j]`` (an int8 copy's own step per row: its
            rounding costs each token its own scale, not the largest).
        token_bound: fp32 ``x [R, d]`` -> fp32 ``[R, 1]``, or None.
        max_token_scale: the largest of ``token_scale``.
        score_rounding: the unit roundoff of the head's scores where they are rounded after the fp32 sum
            (``2^-8``: a bf16 head's), else 0; :meth:`ArgmaxScreen.logits` widens its threshold by it.
        storage: what holds the copy's bytes; copies with the same storage share them (the two int8 copies).
    """

    name: str
    product: Callable[[torch.Tensor], torch.Tensor]
    error_bound: Callable[[torch.Tensor], torch.Tensor]
    bytes: int
    token_scale: torch.Tensor | None = None
    token_bound: Callable[[torch.Tensor], torch.Tensor] | None = None
    max_token_scale: float = 0.0
    score_rounding: float = 0.0
    storage: object = None


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

    def error_bound(self, x: torch.Tensor, activation_steps: float, terms: int,
                    bf16_score: bool = False) -> torch.Tensor:
        """The bound for rows ``x``, less the weights' rounding (:meth:`weight_rounding`), where each activation row
        is rounded to ``max|x| / activation_steps`` steps (``inf``: not rounded), with fp32 sums of ``terms``
        terms in the copy and the score; ``bf16_score``: the score's denormal operands and products count as
        zero (``vdpbf16ps``), at most ``2^-126`` each (its rounding to bf16: :attr:`ScreenProduct.score_rounding`)."""
        ax = x.abs()
        g = 2 * _summation_bound(terms)
        amax = ax.amax(dim=1, keepdim=True)
        bound = amax * (self.code_mass / (2 * activation_steps)) + x.norm(dim=1, keepdim=True) * (g * self.wmax)
        if bf16_score:
            bound = bound + (amax + 127 * self.max_scale + 1) * (terms * 2.0**-126)
        return BOUND_SLACK * bound

    def weight_rounding(self, x: torch.Tensor) -> torch.Tensor:
        """``[R, 1]``: times token ``j``'s scale ``s_j``, the bound on the weights' rounding
        (``|w_ji - s_j q_ji| <= s_j / 2``, so ``s_j / 2 * ||x||_1``), with :data:`BOUND_SLACK`."""
        return x.abs().sum(dim=1, keepdim=True) * (BOUND_SLACK / 2)

    def bytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4


def int8_screen(weight: torch.Tensor, copy: _Int8Copy | None = None, bf16_score: bool = False) -> ScreenProduct:
    """A per-row symmetric int8 copy of ``weight`` (fp32 ``[V, d]``, ``d % 32 == 0``) on llminfer's
    :func:`~llminfer.kernels.linear.int8_linear` (``V * d`` bytes plus a scale per row).

    Its bound for row ``x``: the weights' rounding (``|w - s q| <= s / 2``) costs token ``j`` at most
    ``s_j / 2 * ||x||_1``; the activations' rounding (14 bits per row on VNNI, none elsewhere) at most
    ``max_j s_j ||q_j||_1 * ||x||_inf / 16382``; the fp32 sums and the fp32 score at most
    ``2 g(2d) * ||x|| * max_j ||w_j||``; all times :data:`BOUND_SLACK`. ``bf16_score``: the candidates are
    scored in bf16 (a bf16 head; :meth:`_Int8Copy.error_bound`). Raises RuntimeError where the kernel is not
    loaded.
    """
    from llminfer.kernels.linear import int8_linear

    c = copy or _Int8Copy.of(weight)
    terms = 2 * weight.shape[1]

    def product(x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x.contiguous(), c.codes, c.scale)

    return ScreenProduct("int8", product, lambda x: c.error_bound(x, 8191.0, terms, bf16_score), c.bytes(),
                         c.scale, c.weight_rounding, c.max_scale, 2.0**-8 if bf16_score else 0.0, c)


def int8_a8_available(in_features: int) -> bool:
    """Whether :func:`int8_a8_screen` runs here: the kernels' AVX-512 VNNI build and ``in_features % 64 == 0``
    (up to 65536)."""
    from llminfer.kernels.build import skinny_linear_available

    if in_features % 64 or in_features > 65536 or not skinny_linear_available():
        return False
    return "zmm" in torch.ops.llminfer_cpu.q8_instruction()


def int8_a8_screen(weight: torch.Tensor, copy: _Int8Copy | None = None, bf16_score: bool = False) -> ScreenProduct:
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

    return ScreenProduct("int8-a8", product, lambda x: c.error_bound(x, 127.0, terms, bf16_score),
                         c.bytes() + sums.numel() * 4, c.scale, c.weight_rounding, c.max_scale,
                         2.0**-8 if bf16_score else 0.0, c)


def int8_screens(weight: torch.Tensor) -> list[ScreenProduct]:
    """:func:`int8_screen` and, where it runs, :func:`int8_a8_screen`, sharing one int8 copy of ``weight``
    (fp32, or bf16: then copied from its fp32 values, with the bounds of a bf16 score)."""
    bf16_score = weight.dtype == torch.bfloat16
    weight = weight.float()
    c = _Int8Copy.of(weight)
    products = [int8_screen(weight, c, bf16_score)]
    if int8_a8_available(weight.shape[1]):
        products.append(int8_a8_screen(weight, c, bf16_score))
    return products
