"""Tokenize stage: prompt text → token ids, with the length checks a request must pass."""

from __future__ import annotations

from typing import Any

from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.errors import InvalidRequestError
from llminfer.kv.hashing import encode_extra_keys
from llminfer.protocols import Tokenizer
from llminfer.protocols.messages import GenerationRequest, RequestFailed, TokenizedRequest
from llminfer.trace import Tracer


class TokenizeStage:
    """Turns :class:`GenerationRequest` into :class:`TokenizedRequest` (or :class:`RequestFailed`).

    Args:
        tokenizer: encodes text prompts (token-id prompts skip it).
        max_model_len: context length in tokens; a prompt must leave room for one generated token.
        vocab_size: token-id prompts must be below it.
    """

    name = "tokenize"

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int | None = None,
                 tracer: Tracer | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tracer = tracer or Tracer(enabled=False)

    def tokenize(self, req: GenerationRequest) -> TokenizedRequest:
        """Tokenize and validate one request.

        Raises:
            InvalidRequestError: empty prompt, prompt too long for the context, bad token ids.
        """
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise InvalidRequestError("prompt is empty")
            ids = tuple(self.tokenizer.encode(req.prompt))
        else:
            ids = tuple(req.prompt)
            if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        if not ids:
            raise InvalidRequestError("prompt is empty (it tokenizes to no tokens)")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len} tokens; "
                "it must leave room for at least one generated token"
            )
        bad = tuple(dict.fromkeys(v for w in req.params.bad_words for v in self.word_variants(w)))
        force = tuple(self.word_variants(w) for w in req.params.force_words)
        return TokenizedRequest(
            request_id=req.request_id,
            prompt_token_ids=ids,
            params=req.params,
            arrival_ns=req.arrival_ns,
            prefix_key=req.prefix_key,
            priority=req.priority,
            extra_keys=encode_extra_keys(req.adapter_name, req.cache_salt),
            bad_words_ids=bad,
            force_words_ids=force,
        )

    def word_variants(self, word: str) -> tuple[tuple[int, ...], ...]:
        """Token sequences of ``word`` with a leading space (first) and without, duplicates removed."""
        texts = [" " + word.lstrip(), word] if not word.startswith(" ") else [word, word.lstrip()]
        seqs = [tuple(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        return tuple(dict.fromkeys(s for s in seqs if s))

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        async with outbox:
            async for msg in inbox:
                if isinstance(msg, GenerationRequest):
                    self.tracer.record(msg.request_id, self.name, "arrived", t_ns=msg.arrival_ns)
                    try:
                        out: Any = self.tokenize(msg)
                        self.tracer.record(msg.request_id, self.name, "tokenized", len(out.prompt_token_ids))
                    except InvalidRequestError as exc:
                        out = RequestFailed(msg.request_id, exc)
                    await outbox.send(out)
                else:
                    await outbox.send(msg)
