"""Tokenize stage: :class:`GenerationRequest` → :class:`TokenizedRequest` through the shared
:class:`~llminfer.frontend.input.InputProcessor` (the HTTP layer validates with the same object)."""

from __future__ import annotations

from typing import Any

from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.errors import EngineError, LLMInferError
from llminfer.frontend.input import InputProcessor
from llminfer.protocols.messages import GenerationRequest, RequestFailed
from llminfer.trace import Tracer


class TokenizeStage:
    """Tokenizes each request; a request that fails (bad input, or any tokenizer error) becomes a
    :class:`RequestFailed` for that request alone, and the stage goes on serving the others.

    Args:
        inputs: the validator and tokenizer.
    """

    name = "tokenize"

    def __init__(self, inputs: InputProcessor, tracer: Tracer | None = None) -> None:
        self.inputs = inputs
        self.tracer = tracer or Tracer(enabled=False)

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        async with outbox:
            async for msg in inbox:
                if isinstance(msg, GenerationRequest):
                    self.tracer.record(msg.request_id, self.name, "arrived", t_ns=msg.arrival_ns)
                    try:
                        out: Any = self.inputs.process(msg)
                        self.tracer.record(msg.request_id, self.name, "tokenized", len(out.prompt_token_ids))
                    except LLMInferError as exc:
                        out = RequestFailed(msg.request_id, exc)
                    except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the stage
                        out = RequestFailed(msg.request_id, EngineError(f"tokenize: {type(exc).__name__}: {exc}"))
                    await outbox.send(out)
                else:
                    await outbox.send(msg)
