"""Request output: a submitted request's handle, which folds its deltas into chunks and a result.

:class:`RequestHandle` is the one place where a request is submitted, its deltas are folded and, when the
caller stops reading before the end (a closed iterator, a cancelled task, a disconnected client), the
request is cancelled: its stream closes at once and an :class:`~llminfer.protocols.messages.Abort` follows
it into the core, which frees its blocks. ``run``, ``stream``, ``generate`` and the HTTP routes all go
through it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import attrs

from llminfer.errors import EngineError, LLMInferError
from llminfer.protocols.messages import GenerationRequest, RequestDelta
from llminfer.results import GenerationResult, GenerationStats, StreamChunk


class ResultBuilder:
    """Folds a request's deltas into :class:`StreamChunk` objects and a final :class:`GenerationResult`.
    The stats are the engine core's record, attached to the final delta (never recomputed here)."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []
        self.prompt_logprobs: tuple[Any, ...] = ()
        self.finish_reason: str | None = None
        self.stats: GenerationStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: RequestDelta) -> StreamChunk:
        """Fold one delta in.

        Raises:
            LLMInferError: the request failed (the error the engine reported for it).
        """
        if delta.error is not None:
            self.finish_reason = delta.finish_reason or "error"
            err = delta.error
            raise err if isinstance(err, LLMInferError) else EngineError(f"{type(err).__name__}: {err}")
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stats = delta.stats
        return StreamChunk(delta.text, delta.token_ids, delta.finished, self.finish_reason, self.stats,
                           delta.logprobs, delta.prompt_logprobs)

    def result(self) -> GenerationResult:
        """The whole result.

        Raises:
            EngineError: the request has not finished.
        """
        if self.finish_reason is None or self.stats is None:
            raise EngineError(f"request {self.request.request_id} ended without a final token")
        return GenerationResult(
            request_id=self.request.request_id,
            generated_text="".join(self.text),
            token_ids=tuple(self.token_ids),
            finish_reason=self.finish_reason,
            stats=self.stats,
            logprobs=tuple(self.logprobs),
            prompt_logprobs=self.prompt_logprobs,
        )


def split_final(chunk: StreamChunk) -> tuple[StreamChunk, ...]:
    """The chunks to hand out for one folded delta: a final delta that still carries text, token ids or
    logprobs becomes a non-final chunk with them, then a final chunk with empty text and only
    ``finish_reason`` and ``stats`` (prompt logprobs, too, ride on the non-final chunk).

    So every piece of output is on a non-final chunk, and a consumer that prints ``chunk.token`` only while
    ``not chunk.is_final`` (the documented loop) prints all of it; joining every chunk gives the same text.
    """
    if not chunk.is_final or not (chunk.token or chunk.token_ids or chunk.logprobs or chunk.prompt_logprobs):
        return (chunk,)
    return (attrs.evolve(chunk, is_final=False, finish_reason=None, stats=None),
            StreamChunk("", (), True, chunk.finish_reason, chunk.stats))


class RequestHandle:
    """One request submitted to a running pipeline.

    Iterate :meth:`chunks` for its :class:`StreamChunk` objects, or await :meth:`collect` for the
    :class:`GenerationResult`. The arrival time is stamped at submission, so latency and TTFT count from
    there.

    Args:
        pipeline: a running :class:`~llminfer.pipeline.Pipeline`.
        request: the request (from ``engine.make_request``).
    """

    def __init__(self, pipeline: Any, request: GenerationRequest) -> None:
        self.pipeline = pipeline
        self.request = attrs.evolve(request, arrival_ns=time.perf_counter_ns())
        self.builder = ResultBuilder(self.request)

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        """The request's chunks as they arrive; leaving early cancels it.

        Raises:
            LLMInferError: the request failed; EngineError: the engine stopped before it finished.
        """
        rid = self.request.request_id
        try:
            # Inside the try: a cancellation that lands in submit() must abort the request too.
            stream = await self.pipeline.submit(self.request)
            async with stream:
                async for delta in stream:
                    for chunk in split_final(self.builder.add(delta)):
                        yield chunk
                    if self.builder.finished:
                        return
            raise EngineError("the engine stopped before the request finished")
        finally:
            if not self.builder.finished:
                self.pipeline.sink.close(rid)
                self.pipeline.abort(rid)

    async def collect(self) -> GenerationResult:
        """Run the request to its end.

        Raises:
            LLMInferError: the request failed.
        """
        async for _ in self.chunks():
            pass
        return self.builder.result()


async def collect_all(pipeline: Any, requests: list[GenerationRequest]) -> list[GenerationResult | LLMInferError]:
    """Run ``requests`` concurrently to their ends; per request its result or the error it failed with."""
    import anyio

    results: list[Any] = [None] * len(requests)

    async def one(i: int) -> None:
        try:
            results[i] = await RequestHandle(pipeline, requests[i]).collect()
        except LLMInferError as exc:
            results[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return results
