"""The engine core when vLLM schedules: each request streams from vLLM in its own task."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import anyio
import attrs
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.backends.vllm.handle import VLLMBackend
from llminfer.errors import EngineError, LLMInferError, RequestAbortedError
from llminfer.protocols.messages import (
    Abort,
    Control,
    DeltaBatch,
    FinishRequest,
    RequestDelta,
    TokenizedRequest,
)
from llminfer.results import GenerationStats
from llminfer.stats import FinishedRequest, IterationStats, StatLogger, record_all
from llminfer.trace import Tracer


class VLLMEngineCore:
    """The engine core when vLLM schedules (see the module docstring): each request streams through
    :meth:`VLLMBackend.generate` in its own task; an :class:`Abort` cancels that task, which aborts the
    request in vLLM. The final delta gets the request's stats, measured here from the request's arrival.

    Statistics (:mod:`llminfer.stats`) are measured here, from the outputs as they arrive: tokens, time to
    first token, inter-token gaps, prompt tokens vLLM found in its prefix cache, finish reasons and
    end-to-end latency (vLLM's own queue, prefill and preemption figures are not in its public output).

    Args:
        backend: the vLLM handle.
        tracer: records the core's trace events.
        stat_loggers: get an :class:`~llminfer.stats.IterationStats` per output and per finish.
    """

    name = "vllm"

    @classmethod
    def from_runtime(cls, rt: Any, cfg: Any, backend: VLLMBackend, tracer: Tracer,
                     stat_loggers: list[StatLogger] | None = None, model_thread: Any = None) -> VLLMEngineCore:
        """The core for ``backend`` (registered in :data:`llminfer.backends.registry.BACKENDS`; the runtime,
        the config and the model thread are not used: vLLM schedules and steps in its own processes)."""
        return cls(backend, tracer, stat_loggers)

    def __init__(self, backend: VLLMBackend, tracer: Tracer | None = None,
                 stat_loggers: list[StatLogger] | None = None) -> None:
        self.backend = backend
        self.tracer = tracer or Tracer(enabled=False)
        self.stat_loggers = stat_loggers if stat_loggers is not None else []
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._drains: list[Any] = []
        self._steps = 0
        self._reading: anyio.CancelScope | None = None  # made in run(): a cancel scope needs an event loop
        self._closing = False

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        self._reading = anyio.CancelScope()
        async with outbox, anyio.create_task_group() as requests_tg:
            with self._reading:
                async for msg in inbox:
                    await self._handle(msg, outbox, requests_tg)
            # the task group now waits for the requests in flight

    async def _handle(self, msg: Any, outbox: ObjectSendStream[Any], requests_tg: Any) -> None:
        if isinstance(msg, TokenizedRequest):
            self._scopes[msg.request_id] = anyio.CancelScope()
            requests_tg.start_soon(self._serve, msg, outbox)
        elif isinstance(msg, Abort):
            scope = self._scopes.get(msg.request_id)
            if scope is not None:
                scope.cancel()
        elif isinstance(msg, Control):
            if msg.action == "reset_prefix_cache":
                await self.backend.reset_prefix_cache()
                if msg.done is not None:
                    msg.done.set()
            elif msg.action == "drain":
                self._drains.append(msg.done)
                self._resolve_drains()
            elif msg.action == "close":
                self._closing = True
                self._resolve_drains()
        elif not isinstance(msg, FinishRequest):  # vLLM applies stop strings itself
            await outbox.send(msg)

    def _resolve_drains(self) -> None:
        if not self._scopes:
            for done in self._drains:
                done.set()
            self._drains.clear()
            if self._closing and self._reading is not None:
                self._reading.cancel()

    async def _send(self, outbox: ObjectSendStream[Any], delta: RequestDelta) -> None:
        self._steps += 1
        await outbox.send(DeltaBatch(self._steps, (delta,), delta.time_ns or time.perf_counter_ns()))

    async def _serve(self, req: TokenizedRequest, outbox: ObjectSendStream[Any]) -> None:
        rid = req.request_id
        scope = self._scopes[rid]
        first_ns = last_ns = 0
        num_tokens = 0
        final: RequestDelta | None = None
        try:
            with scope:
                self.tracer.record(rid, self.name, "queued", len(req.prompt_token_ids))
                async for delta in self.backend.generate(req):
                    num_tokens += len(delta.token_ids)
                    if self.stat_loggers:
                        self._record_output(req, delta, num_tokens == len(delta.token_ids), last_ns)
                    if delta.token_ids:
                        first_ns = first_ns or delta.time_ns
                        last_ns = delta.time_ns
                    if delta.finished:
                        final = delta
                        break
                    await self._send(outbox, attrs.evolve(delta, stats=None))
                if final is None and not scope.cancel_called:
                    final = RequestDelta(rid, "", (), "error", EngineError("vLLM ended the stream early"))
        except LLMInferError as exc:
            final = RequestDelta(rid, "", (), "error", exc)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the core
            final = RequestDelta(rid, "", (), "error", EngineError(f"vLLM: {type(exc).__name__}: {exc}"))
        finally:
            self._scopes.pop(rid, None)
        with anyio.CancelScope(shield=True):
            if final is None:  # aborted
                with contextlib.suppress(Exception):
                    await self.backend.abort(rid)
                final = RequestDelta(rid, "", (), "abort", RequestAbortedError("request cancelled"))
            end_ns = final.time_ns or time.perf_counter_ns()
            stats = _stats(req, final.stats, first_ns, end_ns, num_tokens)
            if self.stat_loggers:
                done = FinishedRequest.from_stats(final.finish_reason or "stop", stats, scheduled=False)
                record_all(self.stat_loggers, IterationStats(finished=[done]))
            await self._send(outbox, attrs.evolve(final, time_ns=end_ns, stats=stats))
        self._resolve_drains()

    def _record_output(self, req: TokenizedRequest, delta: RequestDelta, first: bool, last_ns: int) -> None:
        """Stats of one output of ``req``: its tokens; on the first output the prompt tokens, the prefix-cache
        lookup and the time to first token; after that the gap since the previous token (``last_ns``)."""
        n = len(delta.token_ids)
        it = IterationStats(num_generation_tokens=n)
        if first and n:
            prompt = len(req.prompt_token_ids)
            it.first_token(prompt, max(delta.time_ns - req.arrival_ns, 0))
            it.prefix_cache_queries = prompt
            it.prefix_cache_hits = delta.stats.cached_tokens if delta.stats is not None else 0
        elif n and last_ns:
            it.next_token(delta.time_ns - last_ns)
        if it:
            record_all(self.stat_loggers, it)

    def cache_stats(self) -> dict[str, Any]:
        """vLLM's prefix-cache figures (see :meth:`VLLMBackend.cache_stats`)."""
        return self.backend.cache_stats()

    def scheduler_stats(self) -> dict[str, int]:
        """``running``: requests streaming from vLLM; ``waiting``: admitted here, no output yet."""
        return {"running": self.backend.num_running, "waiting": max(len(self._scopes) - self.backend.num_running, 0)}

    def describe(self) -> dict[str, Any]:
        """vLLM's facts for ``engine.info()`` (see :meth:`VLLMBackend.describe`)."""
        return self.backend.describe()

def _stats(req: TokenizedRequest, seen: GenerationStats | None, first_ns: int, end_ns: int,
           num_tokens: int) -> GenerationStats:
    """A vLLM request's stats record, from its arrival and the times its outputs came."""
    total_ms = max(end_ns - req.arrival_ns, 0) / 1e6
    cached = seen.cached_tokens if seen is not None else 0
    return GenerationStats(
        total_latency_ms=total_ms,
        ttft_ms=max(first_ns - req.arrival_ns, 0) / 1e6 if first_ns else 0.0,
        throughput_tokens_per_sec=num_tokens / (total_ms / 1e3) if total_ms > 0 else 0.0,
        prompt_tokens=len(req.prompt_token_ids), completion_tokens=num_tokens, cache_hit=cached > 0,
        cached_tokens=cached)
