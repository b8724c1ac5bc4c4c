"""One way for a request over HTTP: the route validates, tokenizes and compiles the constraint once, and
submits the tokenized request, which the engine's tokenize stage passes on (on the built-in random Qwen2,
behind a live loopback server)."""

from __future__ import annotations

import httpx
import pytest

from llminfer import EngineConfig, InferenceEngine
from llminfer.api import create_app, serve_in_thread
from llminfer.protocols.messages import TokenizedRequest

SCHEMA = {"type": "object", "properties": {"pet": {"type": "string", "enum": ["cat", "dog"]}},
          "required": ["pet"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served():
    engine = InferenceEngine(EngineConfig(max_batch_size=8, batch_timeout_ms=1))
    with serve_in_thread(create_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as http:
        yield http, engine


class Spy:
    """Wraps ``owner.name`` and counts its calls (and the first argument of each)."""

    def __init__(self, monkeypatch, owner, name):
        self.calls: list = []
        real = getattr(owner, name)

        def spy(*args, **kwargs):
            self.calls.append(args[0] if args else None)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)


def _stage(engine, name):
    return next(s for s in engine._pipeline.stages if s.name == name)


@pytest.mark.parametrize("stream", [False, True])
def test_a_constrained_chat_call_is_tokenized_and_compiled_once(served, monkeypatch, stream):
    http, engine = served
    encode = Spy(monkeypatch, engine.tokenizer, "encode")
    compiles = Spy(monkeypatch, engine.runtime.grammar_compiler, "submit")
    stage = _stage(engine, "tokenize")
    staged = Spy(monkeypatch, stage, "tokenize")
    passed = Spy(monkeypatch, _stage(engine, "core"), "_admit")
    body = {"messages": [{"role": "user", "content": "A pet?"}], "max_tokens": 20, "n": 2, "temperature": 0,
            "stream": stream, "bad_words": ["zebra"],
            "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    # The chat template's rendering is tokenized once; the bad word's two variants once each (not per stage).
    assert len([t for t in encode.calls if "A pet?" in t]) == 1
    assert len([t for t in encode.calls if "zebra" in t]) == 2
    assert len(compiles.calls) == 1  # one compile for the call; its two choices share it
    assert staged.calls == []  # the tokenize stage tokenized nothing: it passed the route's requests on
    assert len(passed.calls) == 2 and all(isinstance(m, TokenizedRequest) for m in passed.calls)
    assert all(m.grammar is not None and m.bad_words_ids for m in passed.calls)


def test_the_tokenize_stage_passes_a_tokenized_request_on_and_tokenizes_the_rest():
    import anyio

    from llminfer.frontend.input import InputProcessor, build_request
    from llminfer.stages import TokenizeStage

    class Tok:
        def encode(self, text, add_special_tokens=True):
            return [len(w) for w in text.split()]

    stage = TokenizeStage(InputProcessor(Tok(), 128, vocab_size=100))
    ready = TokenizedRequest("t", (1, 2), build_request([1, 2]).params, 0)

    async def go():
        send, inbox = anyio.create_memory_object_stream(4)
        outbox, out = anyio.create_memory_object_stream(4)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stage.run, inbox, outbox)
            for msg in (ready, build_request("a bb ccc")):
                await send.send(msg)
            first, second = await out.receive(), await out.receive()
            send.close()
        return first, second

    first, second = anyio.run(go)
    assert first is ready
    assert isinstance(second, TokenizedRequest) and second.prompt_token_ids == (1, 2, 3)


@pytest.mark.parametrize(("extra", "param"), [({"logit_bias": {"999999": 1}}, "logit_bias"),
                                               ({"stop_token_ids": [999999]}, "stop_token_ids"),
                                               ({"max_tokens": 10**6}, "messages")])
def test_what_the_route_validates_is_a_400_before_anything_runs(served, monkeypatch, extra, param):
    http, engine = served
    passed = Spy(monkeypatch, _stage(engine, "core"), "_admit")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert passed.calls == []
