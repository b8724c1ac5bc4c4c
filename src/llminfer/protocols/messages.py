"""Messages that travel between pipeline stages: frozen, slotted attrs classes.

Granularity: requests enter one message each; after that, one message per *engine step* carries every
scheduled sequence (``SchedulerOutput``, ``StepOutput``, ``EngineStepOutput``, ``DeltaBatch``), never one
message per token per stage.
"""

from __future__ import annotations

from typing import Any

import attrs

from llminfer.sampling.params import SamplingParams


@attrs.frozen
class GenerationRequest:
    """A request as submitted. ``prompt`` is text, or token ids (then tokenization is skipped)."""

    request_id: str
    prompt: str | tuple[int, ...]
    params: SamplingParams
    arrival_ns: int
    prefix_key: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    adapter_name: str | None = None


@attrs.frozen
class TokenizedRequest:
    """A request with its prompt token ids and, after the prefix-hash stage, its full-block hashes."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_ns: int
    prefix_key: str | None = None
    priority: int = 0
    extra_keys: tuple[str, ...] = ()
    block_hashes: tuple[bytes, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    force_words_ids: tuple[tuple[tuple[int, ...], ...], ...] = ()


@attrs.frozen
class RequestFailed:
    """A request rejected before it reached the scheduler (passed downstream to its handle)."""

    request_id: str
    error: Exception


@attrs.frozen
class Abort:
    """Stop a request and free its KV blocks now (client cancel, stop-string finish, shutdown)."""

    request_id: str
    reason: str = "abort"


@attrs.frozen
class ScheduledSequence:
    """One sequence's share of an engine step.

    Attributes:
        request_id: the request.
        token_ids: the tokens whose KV is computed this step (a prefill chunk, or the one decode token).
        start_position: position of ``token_ids[0]`` (= tokens already computed, ``num_computed_tokens``).
        block_table: KV block ids covering positions ``0 .. start_position + len(token_ids) - 1``.
        sample: True when this step completes the known tokens, so a next token is sampled.
        num_generated: tokens generated so far (for min_new_tokens).
        num_lookahead: speculative decoding: slots reserved after the new token for up to this many draft
            tokens, verified by the target in this step (0 = plain decode).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    sample: bool
    num_generated: int = 0
    num_lookahead: int = 0


@attrs.frozen
class NewRequestData:
    """Sent to the step stage once, the first time a request is scheduled: what the sampler needs."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    force_words_ids: tuple[tuple[tuple[int, ...], ...], ...] = ()


@attrs.frozen
class SchedulerOutput:
    """One engine step's plan: what to compute for which sequence."""

    step_id: int
    sequences: tuple[ScheduledSequence, ...]
    new_requests: tuple[NewRequestData, ...] = ()
    finished_request_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


@attrs.frozen
class StepOutput:
    """The backend's answer to a :class:`SchedulerOutput`: per sampling sequence one token, or with
    speculative decoding a tuple (accepted draft tokens, then the target's own token); ``spec`` maps a
    request to ``(drafts proposed, drafts accepted)``."""

    step_id: int
    sampled: dict[str, int | tuple[int, ...]]
    start_ns: int
    end_ns: int
    error: Exception | None = None
    logprobs: dict[str, Any] = attrs.field(factory=dict)
    spec: dict[str, tuple[int, int]] = attrs.field(factory=dict)


@attrs.frozen
class SequenceUpdate:
    """What happened to one request in a step, from the scheduler's point of view."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: Exception | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    num_preemptions: int = 0
    queue_time_ns: int = 0
    prefill_time_ns: int = 0
    logprobs: tuple[Any, ...] = ()
    spec_proposed: int = 0
    spec_accepted: int = 0


@attrs.frozen
class EngineStepOutput:
    """Scheduler → detokenize: every update of one engine step."""

    step_id: int
    updates: tuple[SequenceUpdate, ...]
    time_ns: int
    admitted: tuple[TokenizedRequest, ...] = ()


@attrs.frozen
class RequestDelta:
    """Detokenize → sink → handle: new text and tokens of one request.

    ``text`` never ends inside a UTF-8 character and never holds any part of a stop string. On the final
    delta ``finish_reason`` is ``"stop"`` or ``"length"`` (or ``"abort"``/``"error"`` with ``error`` set).
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    error: Exception | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    num_preemptions: int = 0
    time_ns: int = 0
    queue_time_ns: int = 0
    prefill_time_ns: int = 0
    logprobs: tuple[Any, ...] = ()
    spec_proposed: int = 0
    spec_accepted: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen
class DeltaBatch:
    """All deltas of one engine step."""

    step_id: int
    deltas: tuple[RequestDelta, ...]
    time_ns: int
