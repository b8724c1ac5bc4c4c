"""Per-request sampling parameters (validated attrs class)."""

from __future__ import annotations

import math
from typing import Any

import attrs

from llminfer.errors import InvalidRequestError
from llminfer.sampling.structured import StructuredOutput

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (argmax): dividing logits by them could overflow to inf."""


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise InvalidRequestError(message, param=param)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_bias(value: Any) -> tuple:
    """``{token_id: bias}`` (keys may be digit strings, as JSON sends them) or pairs, as sorted pairs."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, dict) else value
    out = []
    for key, bias in items:
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        out.append((key, bias))
    return tuple(sorted(out, key=lambda kv: kv[0] if _is_int(kv[0]) else -1))


def _as_tuple(value: Any) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one request is decoded.

    Attributes:
        max_new_tokens: most tokens to generate (> 0); the prompt plus this must fit in the context and
            the KV pool, or the request is refused at once. ``None``: until the context
            (``max_model_len``) or what the KV pool holds for one request fills (``finish_reason``
            ``"length"``).
        min_new_tokens: EOS, stop token ids and stop strings are ignored until this many tokens exist
            (vLLM's ``min_tokens``; a structured-output constraint still ends the output where it is complete).
        temperature: 0 means greedy (argmax); otherwise logits are divided by it before sampling.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability sums to ``top_p``.
        top_k: keep the ``top_k`` most likely tokens (0 = off).
        min_p: drop tokens whose probability is below ``min_p`` times the top token's.
        typical_p: locally typical sampling, keep the tokens whose surprisal is closest to the entropy
            until their probability reaches ``typical_p`` (1 = off).
        epsilon_cutoff: drop tokens whose probability is below it, keeping the top one (0 = off).
        stop_sequences: strings that end generation; the text stops before the earliest match.
        stop_token_ids: extra token ids that end generation (the token is not part of the text).
        ignore_eos: keep generating past the model's EOS token.
        seed: seeds this request's own ``torch.Generator``: a seeded request gives the same tokens
            whatever else shares its batch.
        repetition_penalty: > 0; 1 = off. Logits of tokens already in prompt or output are divided by it
            (multiplied when negative), as Hugging Face's ``RepetitionPenaltyLogitsProcessor``.
        presence_penalty, frequency_penalty: in [-2, 2], OpenAI definitions over output tokens:
            ``logit -= presence * (count > 0) + frequency * count``.
        no_repeat_ngram_size: no n-gram of this size occurs twice in prompt + output (0 = off).
        bad_words: words or phrases never generated (every tokenization with and without a leading space).
        force_words: phrases that must appear in the output (see ``sampling.processors.ForcedWords``).
        logprobs: None = off; k >= 0 returns the chosen token's log-probability and the top-k alternatives.
        n: number of samples of the prompt (the engine fans out; their prompt KV blocks are shared).
        prompt_logprobs: None = off; k >= 0 returns, for every prompt token after the first, its
            log-probability under the raw model (no processors) and the top-k alternatives, computed in the
            prefill. Such a request takes no prefix-cache hits (cached tokens would skip the prefill that
            yields them) until its prompt logprobs are complete.
        logit_bias: ``(token id, bias)`` pairs added to the logits before every other processor (OpenAI's
            ``logit_bias``; bias in [-100, 100], -100 in effect bans the token, +100 forces it).
        include_stop_str_in_output: the matched stop string stays in the text (default: cut before it).
        skip_special_tokens: leave special tokens (``<|im_end|>``, ...) out of the text.
        spaces_between_special_tokens: passed to ``tokenizer.decode`` (only slow tokenizers use it).
        structured_output: a constraint the output must satisfy (JSON Schema, JSON object, regex, grammar
            or choice; see :mod:`llminfer.sampling.structured`). The output ends where the constraint is
            complete, so ``ignore_eos`` cannot be combined with it.

    Raises:
        InvalidRequestError: a value is out of range (the message names the field).
    """

    max_new_tokens: int | None = 16
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    stop_sequences: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple)
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    force_words: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    logprobs: int | None = None
    n: int = 1
    structured_output: StructuredOutput | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_as_bias)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __attrs_post_init__(self) -> None:
        m = self.max_new_tokens
        _check(m is None or (isinstance(m, int) and not isinstance(m, bool) and m > 0),
               "max_new_tokens", f"max_new_tokens must be a positive integer, got {m!r}")
        _check(_is_int(self.min_new_tokens) and self.min_new_tokens >= 0,
               "min_new_tokens", f"min_new_tokens must be >= 0, got {self.min_new_tokens!r}")
        _check(m is None or self.min_new_tokens <= m,
               "min_new_tokens", f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({m})")
        t = self.temperature
        _check(_is_num(t) and t >= 0,
               "temperature", f"temperature must be a finite number >= 0, got {t!r}")
        _check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0,
               "top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
               "min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(_is_num(self.typical_p) and 0.0 < self.typical_p <= 1.0,
               "typical_p", f"typical_p must be in (0, 1], got {self.typical_p!r}")
        _check(_is_num(self.epsilon_cutoff) and 0.0 <= self.epsilon_cutoff < 1.0,
               "epsilon_cutoff", f"epsilon_cutoff must be in [0, 1), got {self.epsilon_cutoff!r}")
        _check(all(isinstance(s, str) and s for s in self.stop_sequences),
               "stop_sequences", "stop_sequences must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "stop_token_ids must be non-negative integers")
        _check(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64), "seed",
               f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        _check(_is_num(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 100,
               "repetition_penalty", f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value!r}")
        _check(_is_int(self.no_repeat_ngram_size) and self.no_repeat_ngram_size >= 0,
               "no_repeat_ngram_size", f"no_repeat_ngram_size must be an integer >= 0, got {self.no_repeat_ngram_size!r}")
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words", "bad_words must be non-empty strings")
        _check(all(isinstance(w, str) and w.strip() for w in self.force_words),
               "force_words", "force_words must be non-empty strings")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        _check(_is_int(self.n) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        pl = self.prompt_logprobs
        _check(pl is None or (_is_int(pl) and 0 <= pl <= 20),
               "prompt_logprobs", f"prompt_logprobs must be an integer in [0, 20], got {pl!r}")
        for key, bias in self.logit_bias:
            _check(_is_int(key) and key >= 0, "logit_bias",
                   f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
            _check(_is_num(bias) and -100.0 <= bias <= 100.0, "logit_bias",
                   f"logit_bias values must be in [-100, 100], got {bias!r} for token {key}")
        _check(len({k for k, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias",
               "logit_bias names a token id twice")
        so = self.structured_output
        _check(so is None or isinstance(so, StructuredOutput), "structured_output",
               f"structured_output must be a StructuredOutput, got {type(so).__name__}")
        _check(so is None or not self.ignore_eos, "ignore_eos",
               "ignore_eos cannot be combined with structured output: the constraint decides where the output ends")
        _check(so is None or not self.force_words, "force_words",
               "force_words cannot be combined with structured output: forcing a phrase could break the constraint")

    @property
    def needs_history(self) -> bool:
        """Some per-row logits processor runs (:data:`~llminfer.sampling.processors.ROW_PROCESSORS`): one
        reading the tokens so far (penalties, no-repeat n-gram, bad/forced words), or ``logit_bias``."""
        # Imported here: the processors module imports torch, which the CLI's flag checks must not load.
        from llminfer.sampling.processors import ROW_PROCESSORS

        return any(processor.applies(self) for processor in ROW_PROCESSORS)

    @property
    def speculation_allowed(self) -> bool:
        """Speculative decoding verifies drafts with the target's warped distribution only, so it serves
        requests without history-dependent processors (``logit_bias`` counts as one), ``min_new_tokens``,
        logprobs or a structured-output constraint; other requests in the same batch decode one token per step."""
        return (not self.needs_history and not self.min_new_tokens and self.logprobs is None
                and self.structured_output is None)

    @property
    def greedy(self) -> bool:
        """Temperature below :data:`GREEDY_TEMPERATURE` is greedy (dividing logits by it would overflow)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop_sequences), default=0)
