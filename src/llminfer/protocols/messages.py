"""Messages that travel between pipeline stages: frozen, slotted attrs classes.

Granularity: requests enter one message each; after that, one message per *engine step* carries every
scheduled sequence (``SchedulerOutput``, ``StepOutput``, ``EngineStepOutput``, ``DeltaBatch``), never one
message per token per stage.

Into the engine core, everything travels on one ordered channel: :class:`GenerationRequest` /
:class:`TokenizedRequest`, :class:`Abort`, :class:`FinishRequest` and :class:`Control`. A request's abort
therefore always reaches the core after the request itself, wherever it was when the abort was sent.
"""

from __future__ import annotations

from typing import Any

import attrs

from llminfer.results import GenerationStats, TokenLogprob
from llminfer.sampling.params import SamplingParams
from llminfer.sampling.structured import GrammarHandle


@attrs.frozen
class GenerationRequest:
    """A request as submitted. ``prompt`` is text, or token ids (then tokenization is skipped)."""

    request_id: str
    prompt: str | tuple[int, ...]
    params: SamplingParams
    arrival_ns: int
    priority: int = 0
    cache_salt: str | None = None
    adapter_name: str | None = None
    prefix_key: str | None = None  #: pin this prompt's shared prefix in the KV cache (KVCacheManager.pin_prefix)


@attrs.frozen
class TokenizedRequest:
    """A request with its prompt token ids and, after the prefix-hash stage, its full-block hashes. The
    HTTP routes submit it as it is (they tokenize and validate once); the tokenize stage makes it from a
    :class:`GenerationRequest` for the Python API."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_ns: int
    priority: int = 0
    extra_keys: tuple[str, ...] = ()
    block_hashes: tuple[bytes, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    force_words_ids: tuple[tuple[tuple[int, ...], ...], ...] = ()
    grammar: GrammarHandle | None = None  #: the structured-output constraint, compiling off the step
    prefix_key: str | None = None  #: see :meth:`llminfer.kv.manager.KVCacheManager.pin_prefix`
    adapter_name: str | None = None  #: the LoRA adapter it was made for (already part of ``extra_keys``)


@attrs.frozen
class RequestFailed:
    """A request rejected before the core admitted it (bad input, can never fit): every stage passes it
    on unchanged, and the sink ends the request's stream with ``error``."""

    request_id: str
    error: Exception


@attrs.frozen
class Abort:
    """Stop a request and free its KV blocks now (client cancel, disconnect); its handle gets
    :class:`~llminfer.errors.RequestAbortedError` naming ``reason``."""

    request_id: str
    reason: str = "cancelled"


@attrs.frozen
class FinishRequest:
    """The front end found a stop string: finish the request with ``finish_reason="stop"``, keeping its
    first ``num_output_tokens`` generated tokens, and free its blocks (sent by the detokenize stage)."""

    request_id: str
    num_output_tokens: int


@attrs.frozen
class Control:
    """An engine-wide command for the core, ordered with the requests around it.

    Attributes:
        action: ``"reset_prefix_cache"`` (forget every cached free block: a cold cache for benchmarks, or
            after an adapter is unloaded) or ``"drain"`` (set ``done`` once every request that entered
            before this message has finished and freed its blocks) or ``"close"`` (take no more requests: finish
            the admitted ones, then end; aborts are still taken meanwhile).
        done: set by the core when the action is complete.
    """

    action: str
    done: Any = None


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
    grammar: Any = None  #: the compiled structured-output grammar (``xgrammar.CompiledGrammar``), or None


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
    request to ``(drafts proposed, drafts accepted)``. ``error`` fails every request of the step (the
    step itself failed); ``failed`` maps a request whose own processing failed to its error (that request
    alone fails)."""

    step_id: int
    sampled: dict[str, int | tuple[int, ...]]
    start_ns: int
    end_ns: int
    error: Exception | None = None
    logprobs: dict[str, TokenLogprob] = attrs.field(factory=dict)
    spec: dict[str, tuple[int, int]] = attrs.field(factory=dict)
    #: requests with ``prompt_logprobs``: (position of the first entry, one entry per prompt position)
    prompt_logprobs: dict[str, tuple[int, tuple[TokenLogprob, ...]]] = attrs.field(factory=dict)
    failed: dict[str, BaseException] = attrs.field(factory=dict)


@attrs.frozen
class SequenceUpdate:
    """What happened to one request in a step, from the core's point of view. The final update
    (``finish_reason`` set) carries the request's stats, computed once at its finish."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: Exception | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    stats: GenerationStats | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  #: all of them, on the request's first token update
    #: the last new token is the EOS or stop token id that finished the request (its text is not output)
    ends_with_stop_token: bool = False


@attrs.frozen
class EngineStepOutput:
    """Scheduler → detokenize: every update of one engine step."""

    step_id: int
    updates: tuple[SequenceUpdate, ...]
    time_ns: int


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
    time_ns: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    stats: GenerationStats | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen
class DeltaBatch:
    """All deltas of one engine step."""

    step_id: int
    deltas: tuple[RequestDelta, ...]
    time_ns: int
