"""Per-request sampling parameters (validated attrs class)."""

from __future__ import annotations

import math
from typing import Any

import attrs

from llminfer.errors import InvalidRequestError


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidRequestError(message)


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
        max_new_tokens: most tokens to generate (> 0). ``None``: until the context (``max_model_len``) fills.
        min_new_tokens: EOS and stop token ids are suppressed until this many tokens exist.
        temperature: 0 means greedy (argmax); otherwise logits are divided by it before sampling.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability sums to ``top_p``.
        top_k: keep the ``top_k`` most likely tokens (0 = off).
        min_p: drop tokens whose probability is below ``min_p`` times the top token's.
        stop_sequences: strings that end generation; the text stops before the earliest match.
        stop_token_ids: extra token ids that end generation (the token is not part of the text).
        ignore_eos: keep generating past the model's EOS token.
        seed: seeds this request's own ``torch.Generator``: a seeded request gives the same tokens
            whatever else shares its batch.

    Raises:
        InvalidRequestError: a value is out of range (the message names the field).
    """

    max_new_tokens: int | None = 16
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop_sequences: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple)
    ignore_eos: bool = False
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        m = self.max_new_tokens
        _check(m is None or (isinstance(m, int) and not isinstance(m, bool) and m > 0),
               f"max_new_tokens must be a positive integer, got {m!r}")
        _check(isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0,
               f"min_new_tokens must be >= 0, got {self.min_new_tokens!r}")
        _check(m is None or self.min_new_tokens <= m,
               f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({m})")
        t = self.temperature
        _check(isinstance(t, (int, float)) and math.isfinite(t) and t >= 0,
               f"temperature must be a finite number >= 0, got {t!r}")
        _check(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(all(isinstance(s, str) and s for s in self.stop_sequences),
               "stop_sequences must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop_sequences), default=0)
