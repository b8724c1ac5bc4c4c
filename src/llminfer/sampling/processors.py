"""Per-request logits processors: one class each, in the order the sampler applies them.

Adding a decoding control is one class here, its field in :class:`~llminfer.sampling.params.SamplingParams`
(validation included) and, for HTTP, the same-named field in the API schema (:mod:`llminfer.api.protocol`);
the sampler, the predicates on ``SamplingParams`` and the HTTP request builder are derived from the lists.

* :data:`ROW_PROCESSORS`: per request, per row, in place on its ``[V]`` float32 logits, before the
  structured-output mask. ``for_request`` makes one instance per request that uses it (its state lives
  there); ``update`` sees each chosen token; ``needs_history`` says it reads the tokens so far;
  ``can_ban_everything`` says it may set every logit to -inf (the sampler then keeps a copy to fall back on).
* the warpers, vectorised and stateless, are in :mod:`llminfer.sampling.warpers`.

Each implements the semantics of the named Hugging Face processor or the cited definition, written anew.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
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


class CallOrAnswer(RowProcessor):
    """Under ``tool_choice: "auto"`` with an answer format, the output is tool calls or an answer
    (:func:`llminfer.tools.answer_format.calls_or_answer`), and the first token picks the branch. The
    constrained distribution would pick it badly: the format's mask takes away the prose a model starts an
    answer with, so the call opening keeps nearly all of what is left (SmolLM2-135M: ``<`` at logprob -0.001
    against ``{`` at -7.2 on "Who wrote Hamlet?", and then a call every time). Here the model's own first
    choice decides, before the mask: when its most likely first token opens a call (one of the
    constraint's ``call_opening_ids``) only those stay, otherwise they are banned and the answer follows.
    Deterministic, whatever the temperature; the tokens after the first are left alone."""

    field = "structured_output"
    in_vllm = False  # vLLM's guided decoding has no hook before its mask

    @staticmethod
    def applies(params: Any) -> bool:
        return params.structured_output is not None and bool(params.structured_output.call_opening_ids)

    def __init__(self, params: Any, history: RequestHistory, context: dict[str, Any]) -> None:
        super().__init__(params, history, context)
        self.opening = torch.tensor(params.structured_output.call_opening_ids, dtype=torch.long,
                                    device=context["device"])

    def __call__(self, row: torch.Tensor, history: RequestHistory) -> None:
        if history.num_generated:
            return
        opening = self.opening[self.opening < row.shape[0]]
        if bool((opening == row.argmax()).any()):
            kept = row[opening].clone()
            row.fill_(NEG_INF)
            row[opening] = kept
        else:
            row[opening] = NEG_INF


#: The per-row processors, in the order they run.
ROW_PROCESSORS: tuple[type[RowProcessor], ...] = (
    LogitBias, RepetitionPenalty, PresenceFrequencyPenalty, NoRepeatNGram, BadWords, ForcedWords, CallOrAnswer,
)
