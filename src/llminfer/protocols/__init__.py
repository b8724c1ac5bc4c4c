"""Typed protocols of the pipeline's building blocks, and the messages between them.

A stage is anything with ``async def run(inbox, outbox)``: it reads messages from ``inbox`` until the
channel ends, writes to ``outbox``, and closes ``outbox`` when done. Messages a stage does not handle pass
through unchanged, so a user stage (a filter, a logger) can sit anywhere without knowing the others.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.protocols.messages import (
    Abort,
    DeltaBatch,
    EngineStepOutput,
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


@runtime_checkable
class Stage(Protocol):
    """A pipeline stage: consume ``inbox`` until it ends, produce into ``outbox``, then close it."""

    name: str

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None: ...


@runtime_checkable
class Tokenizer(Protocol):
    """The subset of a Hugging Face tokenizer llminfer uses."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


@runtime_checkable
class Backend(Protocol):
    """Runs one engine step. Called from a worker thread, one step at a time.

    ``execute`` takes a :class:`SchedulerOutput` and returns a :class:`StepOutput` with one sampled token
    id per sequence whose ``sample`` flag is set. It must not raise: errors go in ``StepOutput.error``.
    """

    name: str

    def execute(self, plan: SchedulerOutput) -> StepOutput: ...


@runtime_checkable
class Sink(Protocol):
    """The last stage: delivers each :class:`RequestDelta` of a :class:`DeltaBatch` somewhere."""

    name: str

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None: ...


__all__ = [
    "Abort",
    "Backend",
    "DeltaBatch",
    "EngineStepOutput",
    "GenerationRequest",
    "NewRequestData",
    "RequestDelta",
    "RequestFailed",
    "ScheduledSequence",
    "SchedulerOutput",
    "SequenceUpdate",
    "Sink",
    "Stage",
    "StepOutput",
    "TokenizedRequest",
    "Tokenizer",
]
