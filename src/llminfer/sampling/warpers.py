"""Warpers: one class each, vectorised over the sampling rows of a step, in the order :data:`WARPERS` lists.

They run after the structured-output mask and the logprobs, on ``[S, V]`` float32 logits, and keep no state
(the per-request logits processors with state are in :mod:`llminfer.sampling.processors`). Adding a warper
is one class here and its entry in :data:`WARPERS`, its field in
:class:`~llminfer.sampling.params.SamplingParams` (validation included) and, for HTTP, the same-named field in
the API schema (:mod:`llminfer.api.protocol`).

Each implements the semantics of the named Hugging Face warper or the cited definition, written anew.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

NEG_INF = float("-inf")


class Warper(ABC):
    """Base of the batched warpers: ``applies(params)`` for one request; ``__call__(logits, params)`` on
    the ``[S, V]`` float32 logits of the sampling rows (``params`` one per row), returning new logits."""

    field: ClassVar[str] = ""  #: as :attr:`llminfer.sampling.processors.RowProcessor.field`
    in_vllm: ClassVar[bool] = True  #: as :attr:`llminfer.sampling.processors.RowProcessor.in_vllm`

    @staticmethod
    @abstractmethod
    def applies(params: Any) -> bool:
        """Whether a request with these sampling parameters uses this warper."""

    @abstractmethod
    def __call__(self, logits: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        """The warped ``[S, V]`` float32 logits of the sampling rows (``params``: one per row)."""


class Temperature(Warper):
    """Divide the logits by the temperature (greedy rows never reach the warpers)."""

    field = "temperature"

    @staticmethod
    def applies(params: Any) -> bool:
        return params.temperature != 1.0

    def __call__(self, logits: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        return logits / torch.tensor([p.temperature for p in params], device=logits.device)[:, None]


class TopK(Warper):
    """Keep each row's ``top_k`` largest logits (0 = off); ties at the k-th value are kept, as in Hugging
    Face's ``TopKLogitsWarper``."""

    field = "top_k"

    @staticmethod
    def applies(params: Any) -> bool:
        return params.top_k > 0

    def __call__(self, logits: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        return apply_top_k(logits, torch.tensor([p.top_k for p in params], device=logits.device))


class TopP(Warper):
    """Nucleus filtering (Holtzman et al. 2019), see :func:`apply_top_p`."""

    field = "top_p"

    @staticmethod
    def applies(params: Any) -> bool:
        return params.top_p < 1.0

    def __call__(self, logits: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        # float64 on the CPU, as the request gave it: not every device has float64.
        return apply_top_p(logits, torch.tensor([p.top_p for p in params], dtype=torch.float64))


class MinP(Warper):
    """Drop tokens whose probability is below ``min_p`` times the row's top probability (Nguyen et al.
    2024; Hugging Face ``MinPLogitsWarper``)."""

    field = "min_p"

    @staticmethod
    def applies(params: Any) -> bool:
        return params.min_p > 0.0

    def __call__(self, logits: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        min_p = torch.tensor([p.min_p for p in params], device=logits.device, dtype=logits.dtype)
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        return logits.masked_fill(probs < threshold, NEG_INF)


class TypicalP(Warper):
    """Locally typical sampling (Meister et al. 2022; Hugging Face ``TypicalLogitsWarper``): keep the
    tokens whose surprisal ``-log p`` is closest to the row's entropy, in that order, until their
    probability reaches ``typical_p`` (at least one token). Rows with ``typical_p`` 1 are unchanged."""

    field = "typical_p"
    in_vllm = False

    @staticmethod
    def applies(params: Any) -> bool:
        return params.typical_p < 1.0

    def __call__(self, logits: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        mass = torch.tensor([p.typical_p for p in params], device=logits.device, dtype=logits.dtype)
        log_probs = logits.log_softmax(dim=-1)
        probs = log_probs.exp()
        entropy = -(probs * log_probs).nan_to_num().sum(dim=-1, keepdim=True)
        shifted = (-log_probs - entropy).abs()  # distance of each token's surprisal from the entropy
        sorted_shifted, order = shifted.sort(dim=-1)
        cum = probs.gather(-1, order).cumsum(dim=-1)
        # The first token (in that order) at which the mass is reached; ties with it are kept too.
        last = (cum < mass[:, None]).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
        keep = shifted <= sorted_shifted.gather(-1, last)
        return torch.where(keep | (mass[:, None] >= 1.0), logits, NEG_INF)


class EpsilonCutoff(Warper):
    """Truncation sampling (Hewitt et al. 2022; Hugging Face ``EpsilonLogitsWarper``): drop the tokens whose
    probability is below ``epsilon_cutoff``, always keeping the most likely (and any tied with it). 0 = off."""

    field = "epsilon_cutoff"
    in_vllm = False

    @staticmethod
    def applies(params: Any) -> bool:
        return params.epsilon_cutoff > 0.0

    def __call__(self, logits: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        epsilon = torch.tensor([p.epsilon_cutoff for p in params], device=logits.device, dtype=logits.dtype)
        probs = logits.softmax(dim=-1)
        drop = (probs < epsilon[:, None]) & (logits < logits.max(dim=-1, keepdim=True).values)
        return logits.masked_fill(drop, NEG_INF)


#: The warpers, in the order they run on the sampling rows.
WARPERS: tuple[Warper, ...] = (Temperature(), TopK(), TopP(), TypicalP(), EpsilonCutoff(), MinP())


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (``top_k`` ``[S]`` int64, 0 = off); others become -inf.
    Ties at the k-th value are kept, as in Hugging Face's ``TopKLogitsWarper``."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, NEG_INF)


_TOP_P_CANDIDATES = 1024


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2019): drop the tokens whose ascending cumulative probability
    is <= ``1 - top_p``, always keeping the most likely one (Hugging Face ``TopPLogitsWarper``).

    For a large vocabulary, when the mass outside the 1,024 most likely tokens is already <= ``1 - top_p``
    (those tokens are dropped anyway), only the candidates are sorted: a full sort of the vocabulary is the
    step's costliest part on CPU otherwise.

    Args:
        logits: ``[S, V]`` float32.
        top_p: ``[S]`` in (0, 1], float64 (as the request gave it): ``1 - top_p`` is taken in float64 and
            then rounded to the logits' dtype, as Hugging Face compares with the Python float ``1 - top_p``
            (a ``top_p`` just below 1 rounds to 1.0 in float32, which would drop nothing).
    """
    vocab = logits.shape[-1]
    drop = (1 - top_p.double()).to(device=logits.device, dtype=logits.dtype)  # [S]: the mass that may be dropped
    if vocab > 4 * _TOP_P_CANDIDATES:
        probs = logits.softmax(dim=-1)
        top_probs, top_idx = probs.topk(_TOP_P_CANDIDATES, dim=-1)  # descending
        outside = (1.0 - top_probs.sum(dim=-1)).clamp_min(0.0)
        if bool((outside <= drop).all()):
            cum = outside[:, None] + top_probs.flip(-1).cumsum(dim=-1)  # ascending, like HF
            remove = cum <= drop[:, None]
            remove[:, -1] = False
            keep = ~remove.flip(-1)
            kept = torch.where(keep, logits.gather(1, top_idx), torch.full_like(top_probs, NEG_INF))
            return torch.full_like(logits, NEG_INF).scatter_(1, top_idx, kept)
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= drop[:, None]
    remove[:, -1] = False
    mask = remove.scatter(1, sorted_idx, remove)
    return logits.masked_fill(mask, NEG_INF)
