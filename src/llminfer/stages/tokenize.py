"""Tokenize stage: :class:`GenerationRequest` → :class:`TokenizedRequest` through the shared
:class:`~llminfer.frontend.input.InputProcessor`. A :class:`TokenizedRequest` (the HTTP routes tokenize and
validate with the same object, once, and submit the result) passes through untouched.

A long prompt is tokenized in a worker thread, so that the event loop (every stream, ``/healthz``) keeps
running meanwhile; a short one inline, where a thread hop would cost more than the tokenizer. Requests
still leave in arrival order (an abort must never overtake its request)."""

from __future__ import annotations

from typing import Any

import anyio.to_thread
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.errors import EngineError, LLMInferError, is_fatal
from llminfer.frontend.input import INLINE_TOKENIZE_CHARS, InputProcessor
from llminfer.protocols.messages import GenerationRequest, RequestFailed, TokenizedRequest
from llminfer.trace import Tracer


def _input_chars(req: GenerationRequest) -> int:
    prompt = len(req.prompt) if isinstance(req.prompt, str) else 0
    words = sum(len(w) for w in (*req.params.bad_words, *req.params.force_words))
    return prompt + words


class TokenizeStage:
    """Tokenizes each request; a request that fails (bad input, or any tokenizer error, a Rust panic
    included) becomes a :class:`RequestFailed` for that request alone, and the stage goes on serving the
    others.

    Args:
        inputs: the validator and tokenizer.
        inline_chars: inputs (prompt plus bad and forced words) up to this many characters are tokenized
            on the event loop, longer ones in a worker thread
            (:data:`~llminfer.frontend.input.INLINE_TOKENIZE_CHARS`).
    """

    name = "tokenize"

    def __init__(self, inputs: InputProcessor, tracer: Tracer | None = None,
                 inline_chars: int = INLINE_TOKENIZE_CHARS) -> None:
        self.inputs = inputs
        self.tracer = tracer or Tracer(enabled=False)
        self.inline_chars = inline_chars

    async def tokenize(self, msg: GenerationRequest) -> Any:
        """The :class:`TokenizedRequest` of ``msg``, or a :class:`RequestFailed` saying why not."""
        try:
            if _input_chars(msg) <= self.inline_chars:
                out: Any = self.inputs.process(msg)
            else:
                if isinstance(msg.prompt, str):  # O(1): never spend a thread on a prompt that cannot fit
                    self.inputs.check_text_size(msg.prompt)
                out = await anyio.to_thread.run_sync(self.inputs.process, msg)
            self.tracer.record(msg.request_id, self.name, "tokenized", len(out.prompt_token_ids))
            return out
        except LLMInferError as exc:
            return RequestFailed(msg.request_id, exc)
        except BaseException as exc:  # noqa: BLE001 - one request's failure must not stop the stage
            if is_fatal(exc):
                raise
            return RequestFailed(msg.request_id, EngineError(f"tokenize: {type(exc).__name__}: {exc}"))

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        async with outbox:
            async for msg in inbox:
                if isinstance(msg, GenerationRequest):
                    self.tracer.record(msg.request_id, self.name, "arrived", t_ns=msg.arrival_ns)
                    await outbox.send(await self.tokenize(msg))
                else:
                    if isinstance(msg, TokenizedRequest):  # tokenized by its HTTP route
                        self.tracer.record(msg.request_id, self.name, "arrived", t_ns=msg.arrival_ns)
                    await outbox.send(msg)
