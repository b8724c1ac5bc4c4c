"""Detokenize stage: incremental detokenization and stop strings.

Incremental detokenization keeps two offsets into the generated ids (the approach of TGI and vLLM's
``detokenize_incrementally``): the text of ``ids[prefix:]`` minus the text of ``ids[prefix:read]`` is
new, and it is released only when it does not end in U+FFFD (a UTF-8 character split across tokens).
The released pieces join to ``tokenizer.decode(ids)``.

Stop strings: only the window that new text can complete is searched, the earliest match wins, and the
last ``max(len(stop)) - 1`` characters are held back while streaming so a half-formed stop string is never
sent. A stop finish sends an :class:`Abort` upstream so the scheduler frees the blocks at once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.protocols import Tokenizer
from llminfer.protocols.messages import (
    Abort,
    DeltaBatch,
    EngineStepOutput,
    RequestDelta,
    SequenceUpdate,
)
from llminfer.sampling.params import SamplingParams
from llminfer.trace import Tracer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        skip_special_tokens: drop special tokens (EOS, ``<|im_end|>``) from the text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: tuple[int, ...] | list[int]) -> str:
        """Append tokens; return the text that became complete (possibly empty)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end of generation: whatever is still held (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""


class StopStringMatcher:
    """Holds back text that could still become a stop string; finds the earliest match.

    Args:
        stop_sequences: the stop strings (non-empty).
    """

    def __init__(self, stop_sequences: tuple[str, ...]) -> None:
        self.stops = stop_sequences
        self.hold = max((len(s) for s in stop_sequences), default=1) - 1
        self.text = ""
        self.released = 0

    def feed(self, new_text: str, final: bool) -> tuple[str, bool]:
        """Add text; return ``(text safe to release, stopped)``. After a stop, the text is cut before it."""
        start = max(0, len(self.text) - self.hold)
        self.text += new_text
        stopped = False
        if self.stops and new_text:
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                stopped = True
        end = len(self.text) if (final or stopped) else max(self.released, len(self.text) - self.hold)
        out = self.text[self.released : end]
        self.released = end
        return out, stopped


class _RequestState:
    __slots__ = ("detok", "matcher", "params")

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer)
        self.matcher = StopStringMatcher(params.stop_sequences) if params.stop_sequences else None


class DetokenizeStage:
    """:class:`EngineStepOutput` → :class:`DeltaBatch` (one message per step).

    The pipeline sets ``control`` to the channel that carries :class:`Abort` back to the scheduler.
    """

    name = "detokenize"

    def __init__(self, tokenizer: Tokenizer, tracer: Tracer | None = None) -> None:
        self.tokenizer = tokenizer
        self.tracer = tracer or Tracer(enabled=False)
        self.control: ObjectSendStream[Abort] | None = None
        self.states: dict[str, _RequestState] = {}
        self._recently_finished: OrderedDict[str, None] = OrderedDict()

    def _finished(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self._recently_finished[request_id] = None
        if len(self._recently_finished) > 100_000:
            self._recently_finished.popitem(last=False)

    def process(self, msg: EngineStepOutput) -> tuple[list[RequestDelta], list[str]]:
        """Detokenize one step. Returns the deltas and the ids of requests a stop string finished."""
        for req in msg.admitted:
            self.states[req.request_id] = _RequestState(self.tokenizer, req.params)
        deltas: list[RequestDelta] = []
        stopped: list[str] = []
        now = msg.time_ns
        for up in msg.updates:
            state = self.states.get(up.request_id)
            if state is None:
                if up.request_id in self._recently_finished:
                    continue  # a late update after a stop-string finish
                if up.finish_reason is not None:  # failed before admission: deliver the error
                    deltas.append(self._delta(up, "", up.finish_reason, now))
                    self._finished(up.request_id)
                continue
            text = state.detok.add(up.new_token_ids) if up.new_token_ids else ""
            final = up.finish_reason is not None
            if final:
                text += state.detok.flush()
            reason = up.finish_reason
            if state.matcher is not None:
                text, hit = state.matcher.feed(text, final)
                if hit:
                    reason = "stop"
                    if not final:
                        stopped.append(up.request_id)
            deltas.append(self._delta(up, text, reason, now))
            if reason is not None:
                self._finished(up.request_id)
        return deltas, stopped

    @staticmethod
    def _delta(up: SequenceUpdate, text: str, reason: str | None, now: int) -> RequestDelta:
        return RequestDelta(
            request_id=up.request_id,
            text=text,
            token_ids=up.new_token_ids,
            finish_reason=reason,
            error=up.error,
            prompt_tokens=up.prompt_tokens,
            cached_tokens=up.cached_tokens,
            num_preemptions=up.num_preemptions,
            time_ns=now,
            queue_time_ns=up.queue_time_ns,
            prefill_time_ns=up.prefill_time_ns,
            logprobs=up.logprobs,
            spec_proposed=up.spec_proposed,
            spec_accepted=up.spec_accepted,
        )

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        async with outbox:
            async for msg in inbox:
                if not isinstance(msg, EngineStepOutput):
                    await outbox.send(msg)
                    continue
                deltas, stopped = self.process(msg)
                if self.control is not None:
                    for rid in stopped:
                        await self.control.send(Abort(rid, "stop_string"))
                if deltas:
                    await outbox.send(DeltaBatch(msg.step_id, tuple(deltas), time.perf_counter_ns()))

