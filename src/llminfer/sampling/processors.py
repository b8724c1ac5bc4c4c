"""Logits processors and warpers: one class each, in the order the sampler applies them.

Adding a decoding control is one class here, its field in :class:`~llminfer.sampling.params.SamplingParams`
(validation included) and, for HTTP, the same-named field in the API schema (:mod:`llminfer.api.protocol`);
the sampler, the predicates on ``SamplingParams`` and the HTTP request builder are derived from the lists.

* :data:`ROW_PROCESSORS`: per request, per row, in place on its ``[V]`` float32 logits, before the
  structured-output mask. ``for_request`` makes one instance per request that uses it (its state lives
  there); ``update`` sees each chosen token; ``needs_history`` says it reads the tokens so far;
  ``can_ban_everything`` says it may set every logit to -inf (the sampler then keeps a copy to fall back on).
* :data:`WARPERS`: vectorised over the sampling rows of a step, after the mask and the logprobs, on
  ``[S, V]`` float32 logits; stateless.

Each implements the semantics of the named Hugging Face processor or the cited definition, written anew.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

NEG_INF = float("-inf")


class RequestHistory:
    """What a row processor may read of its request: prompt and output token ids (``token_ids``, the
    prompt's ``num_prompt`` first), and the request's banned/forced word ids from the tokenize stage."""

    token_ids: list[int]
    num_prompt: int

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt


class RowProcessor(ABC):
    """Base of the per-row processors (see the module docstring). ``params`` is the request's
    :class:`~llminfer.sampling.params.SamplingParams`."""

    needs_history: ClassVar[bool] = True
    can_ban_everything: ClassVar[bool] = False
    #: the SamplingParams field that turns it on (named in errors)
    field: ClassVar[str] = ""
    #: vLLM's SamplingParams has an equivalent (the vLLM backend refuses the others by this flag)
    in_vllm: ClassVar[bool] = True

    @staticmethod
    @abstractmethod
    def applies(params: Any) -> bool:
        """Whether a request with these sampling parameters uses this processor."""

    @classmethod
    def for_request(cls, params: Any, history: RequestHistory, context: dict[str, Any]) -> RowProcessor | None:
        """This request's instance, or None when ``params`` does not use it. ``context`` holds ``device``,
        ``bad_words_ids``, ``force_words_ids`` (tokenized by the front end)."""
        return cls(params, history, context) if cls.applies(params) else None

    def __init__(self, params: Any, history: RequestHistory, context: dict[str, Any]) -> None:
        self.params = params

    def update(self, history: RequestHistory, token: int) -> None:  # noqa: B027 - most processors keep no state
        """``token`` was chosen (it is already the last of ``history.token_ids``)."""

    @abstractmethod
    def __call__(self, row: torch.Tensor, history: RequestHistory) -> None:
        """Change the request's ``[V]`` float32 logits ``row`` in place."""


class LogitBias(RowProcessor):
    """OpenAI's ``logit_bias``: add each token's bias, first of all processors."""

    field = "logit_bias"

    needs_history = False

    @staticmethod
    def applies(params: Any) -> bool:
        return bool(params.logit_bias)

    def __init__(self, params: Any, history: RequestHistory, context: dict[str, Any]) -> None:
        super().__init__(params, history, context)
        ids, values = zip(*params.logit_bias)
        self.ids = torch.tensor(ids, dtype=torch.long, device=context["device"])
        self.values = torch.tensor(values, dtype=torch.float32, device=context["device"])

    def __call__(self, row: torch.Tensor, history: RequestHistory) -> None:
        row[self.ids] += self.values.to(row.dtype)


class RepetitionPenalty(RowProcessor):
    """Hugging Face ``RepetitionPenaltyLogitsProcessor`` (Keskar et al. 2019): the logit of every token in
    prompt + output is divided by the penalty when positive, multiplied when negative."""

    field = "repetition_penalty"

    @staticmethod
    def applies(params: Any) -> bool:
        return params.repetition_penalty != 1.0

    def __init__(self, params: Any, history: RequestHistory, context: dict[str, Any]) -> None:
        super().__init__(params, history, context)
        self.seen: torch.Tensor | None = None  # history as a tensor, rebuilt after each new token

    def update(self, history: RequestHistory, token: int) -> None:
        self.seen = None

    def __call__(self, row: torch.Tensor, history: RequestHistory) -> None:
        if not history.token_ids:
            return
        if self.seen is None:
            self.seen = torch.tensor(history.token_ids, dtype=torch.long, device=row.device)
        penalty = self.params.repetition_penalty
        score = row[self.seen]
        row[self.seen] = torch.where(score < 0, score * penalty, score / penalty)


class PresenceFrequencyPenalty(RowProcessor):
    """OpenAI's presence and frequency penalties over output tokens:
    ``logit -= presence * (count > 0) + frequency * count``."""

    field = "presence_penalty"

    @staticmethod
    def applies(params: Any) -> bool:
        return bool(params.presence_penalty or params.frequency_penalty)

    def __init__(self, params: Any, history: RequestHistory, context: dict[str, Any]) -> None:
        super().__init__(params, history, context)
        self.counts: Counter[int] = Counter()

    def update(self, history: RequestHistory, token: int) -> None:
        self.counts[token] += 1

    def __call__(self, row: torch.Tensor, history: RequestHistory) -> None:
        if not self.counts:
            return
        ids = torch.tensor(list(self.counts.keys()), dtype=torch.long, device=row.device)
        counts = torch.tensor(list(self.counts.values()), dtype=row.dtype, device=row.device)
        row[ids] -= self.params.frequency_penalty * counts + self.params.presence_penalty


class NoRepeatNGram(RowProcessor):
    """Hugging Face ``NoRepeatNGramLogitsProcessor``: no n-gram of size ``no_repeat_ngram_size`` occurs
    twice in prompt + output (the tokens that would complete a seen n-gram are banned)."""

    field = "no_repeat_ngram_size"
    in_vllm = False

    can_ban_everything = True

    @staticmethod
    def applies(params: Any) -> bool:
        return bool(params.no_repeat_ngram_size)

    def __init__(self, params: Any, history: RequestHistory, context: dict[str, Any]) -> None:
        super().__init__(params, history, context)
        n = self.n = params.no_repeat_ngram_size
        self.ngrams: dict[tuple[int, ...], set[int]] = {}
        tokens = history.token_ids
        for start in range(len(tokens) - n + 1):
            gram = tokens[start : start + n]
            self.ngrams.setdefault(tuple(gram[:-1]), set()).add(gram[-1])

    def update(self, history: RequestHistory, token: int) -> None:
        if len(history.token_ids) >= self.n:
            gram = history.token_ids[-self.n :]
            self.ngrams.setdefault(tuple(gram[:-1]), set()).add(gram[-1])

    def __call__(self, row: torch.Tensor, history: RequestHistory) -> None:
        n, tokens = self.n, history.token_ids
        if len(tokens) + 1 >= n:
            banned = self.ngrams.get(tuple(tokens[len(tokens) - n + 1 :]) if n > 1 else ())
            if banned:
                row[list(banned)] = NEG_INF


class BadWords(RowProcessor):
    """Hugging Face ``NoBadWordsLogitsProcessor``: a one-token word is always banned; a longer one's last
    token is banned right after the rest of it."""

    field = "bad_words"

    can_ban_everything = True

    @staticmethod
    def applies(params: Any) -> bool:
        return bool(params.bad_words)

    @classmethod
    def for_request(cls, params: Any, history: RequestHistory, context: dict[str, Any]) -> RowProcessor | None:
        return cls(params, history, context) if context.get("bad_words_ids") else None

    def __init__(self, params: Any, history: RequestHistory, context: dict[str, Any]) -> None:
        super().__init__(params, history, context)
        words = context["bad_words_ids"]
        self.single = [w[0] for w in words if len(w) == 1]
        self.multi = [w for w in words if len(w) > 1]

    def __call__(self, row: torch.Tensor, history: RequestHistory) -> None:
        if self.single:
            row[self.single] = NEG_INF
        tokens = history.token_ids
        for word in self.multi:
            prefix = word[:-1]
            if len(tokens) >= len(prefix) and tuple(tokens[-len(prefix) :]) == prefix:
                row[word[-1]] = NEG_INF


class ForcedWords(RowProcessor):
    """Forced phrases: each must appear in the output.

    Mechanism: a phrase that has not appeared yet is *forced* (every other logit masked) once the tokens
    left in the budget are just enough for all unsatisfied phrases, or at once when the budget is open
    (``max_new_tokens=None``); a phrase being forced is continued to its end; EOS and stop ids are masked
    while any phrase is unsatisfied (the sampler asks :attr:`pending`). Guarantee: every phrase (as one of
    its tokenizations) is in the output when ``max_new_tokens`` >= the sum of the phrases' token lengths,
    unless a stop string ends the text first. A phrase that appears naturally counts as satisfied.
    """

    field = "force_words"
    in_vllm = False

    @staticmethod
    def applies(params: Any) -> bool:
        return bool(params.force_words)

    @classmethod
    def for_request(cls, params: Any, history: RequestHistory, context: dict[str, Any]) -> RowProcessor | None:
        return cls(params, history, context) if context.get("force_words_ids") else None

    def __init__(self, params: Any, history: RequestHistory, context: dict[str, Any]) -> None:
        super().__init__(params, history, context)
        self.phrases = [tuple(variants) for variants in context["force_words_ids"] if variants]
        self.max_new_tokens = params.max_new_tokens
        self.satisfied = [False] * len(self.phrases)
        self.active: tuple[int, ...] | None = None
        self.position = 0

    def update(self, history: RequestHistory, token: int) -> None:
        output = history.token_ids[history.num_prompt :]
        for i, variants in enumerate(self.phrases):
            if not self.satisfied[i]:
                for v in variants:
                    n = len(v)
                    if n <= len(output) and tuple(output[-n:]) == v:
                        self.satisfied[i] = True
        if self.active is not None:
            self.position += 1
            if self.position >= len(self.active):
                self.active = None

    @property
    def pending(self) -> bool:
        return not all(self.satisfied)

    def forced_token(self, num_generated: int) -> int | None:
        if self.active is None:
            todo = [self.phrases[i][0] for i, ok in enumerate(self.satisfied) if not ok]
            if not todo:
                return None
            need = sum(len(v) for v in todo)
            left = None if self.max_new_tokens is None else self.max_new_tokens - num_generated
            if left is not None and left > need:
                return None
            self.active, self.position = todo[0], 0
        return self.active[self.position]

    def __call__(self, row: torch.Tensor, history: RequestHistory) -> None:
        token = self.forced_token(history.num_generated)
        if token is not None:
            keep = row[token].clone()
            row.fill_(NEG_INF)
            row[token] = keep if torch.isfinite(keep) else 0.0


#: The per-row processors, in the order they run.
ROW_PROCESSORS: tuple[type[RowProcessor], ...] = (
    LogitBias, RepetitionPenalty, PresenceFrequencyPenalty, NoRepeatNGram, BadWords, ForcedWords,
)


# ---------------------------------------------------------------------------- warpers (batched)
class Warper(ABC):
    """Base of the batched warpers: ``applies(params)`` for one request; ``__call__(logits, params)`` on
    the ``[S, V]`` float32 logits of the sampling rows (``params`` one per row), returning new logits."""

    field: ClassVar[str] = ""  #: as :attr:`RowProcessor.field`
    in_vllm: ClassVar[bool] = True  #: as :attr:`RowProcessor.in_vllm`

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


#: The warpers, in the order they run on the sampling rows.
WARPERS: tuple[Warper, ...] = (Temperature(), TopK(), TopP(), TypicalP(), MinP())


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
