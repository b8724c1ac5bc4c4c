"""Detokenize stage: incremental detokenization and stop strings.

Incremental detokenization keeps two offsets into the generated ids (the approach of TGI and vLLM's
``detokenize_incrementally``): the text of ``ids[prefix:]`` minus the text of ``ids[prefix:read]`` is
new, and it is released only when it does not end in U+FFFD (a UTF-8 character split across tokens).
The released pieces join to ``tokenizer.decode(ids)``. For a transformers tokenizer backed by the
``tokenizers`` library, the same algorithm runs in Rust (``tokenizers.decoders.DecodeStream``, one call a
token instead of two ``decode`` calls through transformers' Python wrappers: 0.7 against 6-31 us a token).

Stop strings: only the window that new text can complete is searched, the earliest match wins, and the
last ``max(len(stop)) - 1`` characters are held back while streaming so a half-formed stop string is never
sent. A stop-string hit sends :class:`FinishRequest` upstream, straight to the core's direct inbox: the core
frees the request's blocks at once and sends its final update (with the stats), which becomes the final
delta. Tokens the request produced meanwhile (the step already under way) are dropped here.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

from llminfer.errors import EngineError
from llminfer.protocols import Tokenizer, Upstream
from llminfer.protocols.messages import (
    Abort,
    DeltaBatch,
    EngineStepOutput,
    FinishRequest,
    GenerationRequest,
    RequestDelta,
    RequestFailed,
    SequenceUpdate,
    TokenizedRequest,
)
from llminfer.sampling.params import SamplingParams
from llminfer.trace import Tracer


def rust_decoder(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` when its ``decode`` is exactly that tokenizer's
    (a transformers ``TokenizersBackend`` that overrides no decoding and cleans up no spaces), else None."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    kind = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or not isinstance(backend, RustTokenizer)
            or kind.decode is not TokenizersBackend.decode or kind._decode is not TokenizersBackend._decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        return None
    return backend


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        skip_special_tokens: drop special tokens (EOS, ``<|im_end|>``) from the text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only a non-default value is passed on: tokenizers without the option then work as before.
        self.decode_kwargs = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self._rust = rust_decoder(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._rust is not None else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, **self.decode_kwargs)

    def add(self, new_ids: tuple[int, ...] | list[int]) -> str:
        """Append tokens; return the text that became complete (possibly empty)."""
        if self._stream is not None:
            return self._add_streamed(new_ids)
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def _add_streamed(self, new_ids: tuple[int, ...] | list[int]) -> str:
        # DecodeStream keeps the same two offsets internally; they are mirrored here for flush().
        pieces = []
        for index, token_id in enumerate(new_ids):
            self.ids.append(token_id)
            try:
                piece = self._stream.step(self._rust, token_id)
            except Exception:  # noqa: BLE001 - DecodeStream refused a step (its prefix check): go on in Python,
                self._stream = None  # where add() first decodes what is held, this token included
                return "".join(pieces) + self.add(new_ids[index + 1 :])
            if piece is not None:
                pieces.append(piece)
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return "".join(pieces)

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
        include_stop: keep the matched stop string in the text (vLLM's ``include_stop_str_in_output``).
    """

    def __init__(self, stop_sequences: tuple[str, ...], include_stop: bool = False) -> None:
        self.stops = stop_sequences
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop_sequences), default=1) - 1
        self.text = ""
        self.released = 0

    def feed(self, new_text: str, final: bool, match: bool = True) -> tuple[str, bool]:
        """Add text; return ``(text safe to release, stopped)``. After a stop, the text is cut before it.
        ``match=False``: no stop string is looked for in this text (the request's ``min_new_tokens`` are not
        reached yet); a later feed still finds one that this text begins."""
        start = max(0, len(self.text) - self.hold)
        self.text += new_text
        stopped = False
        if self.stops and new_text and match:
            hits = [(i, -len(s)) for s, i in ((s, self.text.find(s, start)) for s in self.stops) if i >= 0]
            if hits:
                at, minus_len = min(hits)  # the earliest match; at one position, the longest stop string
                self.text = self.text[: at - minus_len if self.include_stop else at]
                stopped = True
        end = len(self.text) if (final or stopped) else max(self.released, len(self.text) - self.hold)
        out = self.text[self.released : end]
        self.released = end
        return out, stopped


class _RequestState:
    __slots__ = ("detok", "matcher", "min_new_tokens", "num_output_tokens", "stopped")

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.min_new_tokens = params.min_new_tokens
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
        self.matcher = (StopStringMatcher(params.stop_sequences, params.include_stop_str_in_output)
                        if params.stop_sequences else None)
        self.num_output_tokens = 0
        self.stopped = False  # a stop string matched; waiting for the core's final update


class DetokenizeStage:
    """:class:`EngineStepOutput` → :class:`DeltaBatch` (one message per step); other messages pass on.

    A request's output state (its incremental detokenizer and stop-string matcher) is made when it is
    submitted (:meth:`add_request`, called by :meth:`Pipeline.submit <llminfer.pipeline.Pipeline.submit>`,
    as vLLM's ``OutputProcessor.add_request``), so its parameters never travel through the engine core to
    get here. It is dropped at the request's final update, or when a :class:`RequestFailed` or a final
    delta made by a core that detokenizes itself (vLLM) passes by. Updates for requests it does not know
    (they finished here already) are dropped.
    """

    name = "detokenize"

    def __init__(self, tokenizer: Tokenizer, tracer: Tracer | None = None) -> None:
        self.tokenizer = tokenizer
        self.tracer = tracer or Tracer(enabled=False)
        self.upstream: Upstream | None = None
        self.states: dict[str, _RequestState] = {}

    def bind_upstream(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def add_request(self, request: GenerationRequest | TokenizedRequest) -> None:
        """Make the output state of a request being submitted (:class:`~llminfer.protocols.TracksRequests`)."""
        self.states[request.request_id] = _RequestState(self.tokenizer, request.params)

    def process(self, msg: EngineStepOutput) -> tuple[list[RequestDelta], list[FinishRequest | Abort]]:
        """Detokenize one step. Returns the deltas and the messages to send upstream: stop-string
        finishes, and aborts of requests whose detokenization failed (each gets an error delta; the
        others go on)."""
        deltas: list[RequestDelta] = []
        upstream: list[FinishRequest | Abort] = []
        now = msg.time_ns
        for up in msg.updates:
            state = self.states.get(up.request_id)
            if state is None:
                continue
            try:
                self._update(state, up, now, deltas, upstream)
            except Exception as exc:  # noqa: BLE001 - that request fails alone
                self._failed(up.request_id, exc, now, deltas, upstream, final=up.finish_reason is not None)
        return deltas, upstream

    def _failed(self, request_id: str, exc: Exception, now: int, deltas: list[RequestDelta],
                upstream: list[FinishRequest | Abort], final: bool = False) -> None:
        self.states.pop(request_id, None)
        error = EngineError(f"detokenize: {type(exc).__name__}: {exc}")
        deltas.append(RequestDelta(request_id, "", (), "error", error, now))
        if not final:  # free its blocks now; the core's final update is dropped here (state gone)
            upstream.append(Abort(request_id, "failed in detokenize"))

    def _update(self, state: _RequestState, up: SequenceUpdate, now: int, deltas: list[RequestDelta],
                upstream: list[FinishRequest | Abort]) -> None:
        final = up.finish_reason is not None
        if state.stopped:
            if final:  # the core confirmed the stop (or ended the request first)
                del self.states[up.request_id]
                stats = up.stats.with_completion_tokens(state.num_output_tokens) if up.stats else None
                deltas.append(RequestDelta(up.request_id, "", (), "stop", None, now, stats=stats))
            return
        # The EOS / stop token id that ended the request is counted and returned as an id, never as text.
        text_ids = up.new_token_ids[:-1] if up.ends_with_stop_token else up.new_token_ids
        text = state.detok.add(text_ids) if text_ids else ""
        if final:
            text += state.detok.flush()
        state.num_output_tokens += len(up.new_token_ids)
        if state.matcher is not None:
            text, hit = state.matcher.feed(text, final, match=state.num_output_tokens >= state.min_new_tokens)
            if hit and not final:
                state.stopped = True
                upstream.append(FinishRequest(up.request_id, state.num_output_tokens))
                deltas.append(RequestDelta(up.request_id, text, up.new_token_ids, None, None, now, up.logprobs,
                                           prompt_logprobs=up.prompt_logprobs))
                return
            if hit:
                up = attrs.evolve(up, finish_reason="stop")
        deltas.append(RequestDelta(up.request_id, text, up.new_token_ids, up.finish_reason, up.error, now,
                                   up.logprobs, up.stats, up.prompt_logprobs))
        if final:
            del self.states[up.request_id]

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        async with outbox:
            async for msg in inbox:
                if not isinstance(msg, EngineStepOutput):
                    self._forget_ended(msg)
                    await outbox.send(msg)
                    continue
                deltas, upstream = self.process(msg)
                if self.upstream is not None:
                    for message in upstream:
                        self.upstream(message)
                if deltas:
                    await outbox.send(DeltaBatch(msg.step_id, tuple(deltas), time.perf_counter_ns()))

    def _forget_ended(self, msg: Any) -> None:
        """Drop the state of requests that ended without an update from this core: failed before
        admission, or finished by a core that makes its own deltas (vLLM)."""
        if isinstance(msg, RequestFailed):
            self.states.pop(msg.request_id, None)
        elif isinstance(msg, DeltaBatch):
            for delta in msg.deltas:
                if delta.finished:
                    self.states.pop(delta.request_id, None)
