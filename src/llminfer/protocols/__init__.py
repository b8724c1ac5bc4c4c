"""Typed protocols of the pipeline's building blocks, and the messages between them.

A stage is anything with ``async def run(inbox, outbox)``: it reads messages from ``inbox`` until the
channel ends, writes to ``outbox``, and closes ``outbox`` when done. Messages a stage does not handle pass
through unchanged, so a user stage (a filter, a logger) can sit anywhere without knowing the others.

The :class:`Pipeline <llminfer.pipeline.Pipeline>` checks these protocols when it is assembled
(``isinstance`` on the runtime-checkable ones): every element is a :class:`Stage`, the last one is a
:class:`Sink`, and a stage that sends messages back into the pipeline's ordered inbox (the detokenize
stage's stop-string finishes, the sink's disconnect aborts) is a :class:`SendsUpstream` and gets the
sender. The engine core (:class:`EngineCore`) is one stage among them: the pipeline needs no special case.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.protocols.messages import (
    Abort,
    Control,
    DeltaBatch,
    EngineStepOutput,
    FinishRequest,
    GenerationRequest,
    NewRequestData,
    RequestDelta,
    RequestFailed,
    ScheduledSequence,
    SchedulerOutput,
    SequenceUpdate,
    StepOutput,
    TokenizedRequest,
)

Upstream = Callable[[Any], None]
"""Puts a message (:class:`Abort`, :class:`FinishRequest`, :class:`Control`) at the tail of the pipeline's
ordered inbox; never blocks (the inbox is unbounded), callable from inside the event loop."""


@runtime_checkable
class Stage(Protocol):
    """A pipeline stage: consume ``inbox`` until it ends, produce into ``outbox``, then close it."""

    name: str

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None: ...


@runtime_checkable
class SendsUpstream(Protocol):
    """A stage that sends messages back into the pipeline's ordered inbox (towards the core)."""

    def bind_upstream(self, upstream: Upstream) -> None: ...


@runtime_checkable
class TakesDirectMessages(Protocol):
    """A stage (the engine core) that also reads a second, direct inbox: :class:`FinishRequest` and
    :class:`Abort` reach it there at once, without waiting behind other requests in the stages before it
    (tokenization). An abort also travels the ordered inbox, since it may overtake its own request on the
    direct one; handling one twice is harmless (unknown ids are ignored)."""

    def bind_direct(self, inbox: ObjectReceiveStream[Any]) -> None: ...


@runtime_checkable
class TracksRequests(Protocol):
    """A stage that keeps per-request state from the moment a request is submitted (the detokenize
    stage's output state, as vLLM's ``OutputProcessor.add_request``): :meth:`Pipeline.submit
    <llminfer.pipeline.Pipeline.submit>` calls :meth:`add_request`, so the request's parameters need not
    travel through the engine core to reach it. The stage drops the state when the request's final delta,
    or its :class:`RequestFailed`, passes it."""

    def add_request(self, request: GenerationRequest | TokenizedRequest) -> None: ...


@runtime_checkable
class Sink(Stage, Protocol):
    """The last stage: delivers each :class:`RequestDelta` to the stream :meth:`open` returned for it,
    and ends a request's stream with its error on :class:`RequestFailed`."""

    def open(self, request_id: str) -> ObjectReceiveStream[RequestDelta]: ...

    def close(self, request_id: str) -> bool: ...

    def fail_all(self, error: Exception) -> None: ...


@runtime_checkable
class Tokenizer(Protocol):
    """The subset of a Hugging Face tokenizer llminfer uses."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


@runtime_checkable
class Backend(Protocol):
    """Runs one engine step. Called from a worker thread, one step at a time.

    ``execute`` takes a :class:`SchedulerOutput` and returns a :class:`StepOutput` with the sampled token
    ids of every sequence whose ``sample`` flag is set. It must not raise: errors go in
    ``StepOutput.error``. ``release(ids)`` drops the per-request state of requests that ended without
    a further step (the core calls it when it stops); ``describe()`` returns facts for ``engine.info()``.
    """

    name: str

    def execute(self, plan: SchedulerOutput) -> StepOutput: ...

    def release(self, request_ids: Sequence[str]) -> None: ...

    def describe(self) -> dict[str, Any]: ...


@runtime_checkable
class EngineCore(Stage, Protocol):
    """The one owner of scheduling and the model: takes :class:`TokenizedRequest`, :class:`Abort`,
    :class:`FinishRequest` and :class:`Control` from its inbox, in order, and emits one message per
    step (:class:`EngineStepOutput` with token ids, or :class:`DeltaBatch` when the backend detokenizes
    itself, as vLLM does). Passes :class:`RequestFailed` and unknown messages on.

    The read-only views (``cache_stats``, ``scheduler_stats``, ``describe``) are safe to call from any
    thread: they read counters the core publishes, never its queues.
    """

    def cache_stats(self) -> dict[str, Any]: ...

    def scheduler_stats(self) -> dict[str, int]: ...

    def describe(self) -> dict[str, Any]: ...


__all__ = [
    "Abort",
    "Backend",
    "Control",
    "DeltaBatch",
    "EngineCore",
    "EngineStepOutput",
    "FinishRequest",
    "GenerationRequest",
    "NewRequestData",
    "RequestDelta",
    "RequestFailed",
    "ScheduledSequence",
    "SchedulerOutput",
    "SendsUpstream",
    "SequenceUpdate",
    "Sink",
    "Stage",
    "StepOutput",
    "TakesDirectMessages",
    "TokenizedRequest",
    "TracksRequests",
    "Tokenizer",
    "Upstream",
]
