"""The rest of the OpenAI surface on a live loopback server: ``POST /v1/responses`` with the official ``openai``
client (text and message input, instructions, usage, the typed stream raw and through ``responses.stream``,
``text.format``, refused fields), the routes (``/health``, ``HEAD`` on every GET, ``/v1/models/{id}`` for an id
starting with ``/``), SSE keep-alives through an idle-timeout proxy, and the OpenAPI document (its limits, its
stream responses, and every advertised request field accepted)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import os
import select
import shutil
import socket
import subprocess
import sys
import threading

import anyio
import httpx
import openai
import pytest

from helpers import TOOLS
from llminfer import EngineConfig, InferenceEngine
from llminfer.api import create_app, serve_in_thread

MODEL = "llminfer/tiny-qwen2"
SERVED = "/srv/models/tiny-qwen2"  # a local-folder id, as `llminfer serve /srv/models/tiny-qwen2` would list
KEEPALIVE_S = 0.25  # the proxy below cuts after 8 of these: room for a loaded machine
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
CHOICE_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
                 "additionalProperties": False}
EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]


@pytest.fixture(scope="module")
def served():
    engine = InferenceEngine(EngineConfig(max_batch_size=4, batch_timeout_ms=1))
    app = create_app(engine, served_model_name=SERVED, sse_keepalive_s=KEEPALIVE_S)
    with serve_in_thread(app) as url:
        # Let the start-up work finish (the grammar compiler's tokenizer info, the chat template's first
        # render), so it does not stall the loop while the keep-alive tests below count on the ticks.
        engine.runtime.grammar_compiler.prepare().result(timeout=300)
        httpx.post(url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 1}, timeout=120)
        yield url, engine, app


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _chat_text(client, messages, max_tokens):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY)
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_text_input_matches_chat_and_reports_usage(client):
    r = client.responses.create(model=MODEL, input="Name three colours.", max_output_tokens=6, **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == SERVED
    # Ran into max_output_tokens: OpenAI's "incomplete" status and reason.
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [c.type for c in item.content] == ["output_text"]
    text, prompt_tokens = _chat_text(client, [{"role": "user", "content": "Name three colours."}], 6)
    assert r.output_text == text  # the same chat template and sampling as /v1/chat/completions
    assert r.usage.input_tokens == prompt_tokens and r.usage.output_tokens == 6
    assert r.usage.total_tokens == prompt_tokens + 6 and r.usage.input_tokens_details.cached_tokens >= 0


def test_usage_names_the_prompt_tokens_read_from_the_prefix_cache(client):
    messages = [{"role": "user", "content": "A prompt of a few blocks, asked twice: " + "colours " * 40}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY).usage
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY).usage
    assert first.prompt_tokens_details.cached_tokens == 0  # present at 0, as OpenAI reports it
    assert 0 < again.prompt_tokens_details.cached_tokens < again.prompt_tokens


def test_messages_and_instructions_are_the_chat_conversation(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "Name three colours."}]
    r = client.responses.create(model=MODEL, input=items, instructions="You are terse.", max_output_tokens=5,
                                **GREEDY)
    assert r.instructions == "You are terse."
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name three colours."}]
    text, prompt_tokens = _chat_text(client, messages, 5)
    assert r.output_text == text and r.usage.input_tokens == prompt_tokens


def test_stream_events_in_order_and_equal_to_the_plain_response(client):
    plain = client.responses.create(model=MODEL, input="Once upon a time", max_output_tokens=7, **GREEDY)
    events = list(client.responses.create(model=MODEL, input="Once upon a time", max_output_tokens=7, stream=True,
                                          **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == EVENT_ORDER
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-4]
    assert deltas == done.text == plain.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == plain.output_text
    assert final.usage.output_tokens == 7 and final.usage.input_tokens == plain.usage.input_tokens
    assert events[0].response.status == "in_progress" and final.status == "incomplete"
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_text_format_json_schema_through_the_stream_helper(client):
    fmt = {"format": {"type": "json_schema", "name": "verdict", "schema": CHOICE_SCHEMA, "strict": True}}
    with client.responses.stream(model=MODEL, input="Yes or no?", text=fmt, max_output_tokens=40,
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()  # needs response.completed: the constraint ended the output
    assert final.status == "completed" and final.incomplete_details is None
    assert json.loads(final.output_text)["answer"] in ("yes", "no") and "".join(deltas) == final.output_text
    assert final.text.format.type == "json_schema"
    plain = client.responses.create(model=MODEL, input="Yes or no?", text={"format": {"type": "json_object"}},
                                    max_output_tokens=40, temperature=0)
    assert isinstance(json.loads(plain.output_text), dict) and plain.status == "completed"


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"background": True}, "background"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ({"input": "word " * 5000}, "input"),  # too long by itself: the input's fault, not max_output_tokens'
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"model": "other"}, "model"),
])
def test_refused_fields_are_error_objects_naming_the_param(served, extra, param):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **extra}
    r = httpx.post(served[0] + "/v1/responses", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error", error


def test_refusal_through_the_client_and_store_false_accepted(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
    assert info.value.body["param"] == "previous_response_id"
    r = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2, **GREEDY)
    assert r.store is False and r.usage.output_tokens == 2


# ---------------------------------------------------------------------------- routes
def test_health_routes_and_head_on_every_get(served, client):
    url = served[0]
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/health").content == b""
    doc = httpx.get(url + "/schema/openapi.json").json()
    gets = [p.replace("{model_id}", SERVED) for p, item in doc["paths"].items() if "get" in item]
    assert {"/health", "/healthz", "/metrics", "/v1/models", "/v1/models/" + SERVED} <= set(gets)
    for path in gets:
        got, head = httpx.get(url + path), httpx.head(url + path)
        assert head.status_code == got.status_code == 200, path
        assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"], path
    assert httpx.head(url + "/v1/models/nope").status_code == 404


def test_model_ids_starting_with_a_slash(served, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [SERVED]
    for model_id in [*ids, MODEL]:
        assert client.models.retrieve(model_id).id == SERVED  # the client joins "/models/" and the id
        r = httpx.get(served[0] + "/v1/models/" + model_id)
        assert r.status_code == 200 and r.json()["id"] == SERVED
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("/srv/models/other")


# ---------------------------------------------------------------------------- keep-alives through a proxy
class IdleProxy:
    """A loopback TCP proxy that cuts a connection once no byte moved either way for ``idle_s`` seconds
    (an nginx ``proxy_read_timeout``); it counts the SSE keep-alive comments it forwards."""

    def __init__(self, upstream: tuple[str, int], idle_s: float) -> None:
        self.upstream, self.idle_s = upstream, idle_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.cond = threading.Condition()
        self.keepalives = 0
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        server = socket.create_connection(self.upstream)
        peer = {client: server, server: client}
        seen = b""
        with client, server:
            while True:
                ready, _, _ = select.select(list(peer), [], [], self.idle_s)
                if not ready:  # idle past the timeout: cut both sides, as an idle-timeout proxy does
                    with self.cond:
                        self.cuts += 1
                        self.cond.notify_all()
                    return
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peer[sock].sendall(data)
                    if sock is server:
                        seen = (seen + data)[-4096:]
                        with self.cond:
                            self.keepalives += data.count(b": keep-alive\n\n")
                            self.cond.notify_all()

    def wait_for(self, predicate) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout=60)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def held(served, monkeypatch):
    """Hold every engine request before it reaches the engine (as a full queue or a long prefill would),
    until ``release`` is set; ``entered`` is set once a request is held."""
    engine = served[1]
    real = engine.generate_request
    entered, release = threading.Event(), threading.Event()

    async def generate_request(request):
        entered.set()
        await anyio.to_thread.run_sync(release.wait, abandon_on_cancel=True)
        async with contextlib.aclosing(real(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    monkeypatch.setattr(engine, "generate_request", generate_request)
    yield entered, release
    release.set()


@pytest.fixture
def proxy(served):
    host, port = served[0].removeprefix("http://").split(":")
    p = IdleProxy((host, int(port)), idle_s=8 * KEEPALIVE_S)
    yield p
    p.close()


def test_a_held_stream_outlives_an_idle_timeout_proxy(served, held, proxy):
    entered, release = held
    with openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=60) as via_proxy:
        # Returns once the response headers are in, while the engine request is still held: they went out
        # before the first token, with a keep-alive.
        stream = via_proxy.responses.create(model=MODEL, input="Hi", max_output_tokens=3, stream=True, **GREEDY)
        assert entered.is_set() and not release.is_set()
        assert stream.response.headers["content-type"].startswith("text/event-stream")
        # Keep-alives go out at least KEEPALIVE_S apart, so after this many the request has waited longer
        # than the proxy's idle timeout.
        needed = math.ceil(proxy.idle_s / KEEPALIVE_S) + 2
        assert proxy.wait_for(lambda: proxy.keepalives >= needed or proxy.cuts)
        assert proxy.cuts == 0
        release.set()
        events = list(stream)
    # The whole stream came through (the proxy may cut the idle keep-alive connection afterwards).
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 3


def test_without_keepalives_the_proxy_cuts_the_held_stream(served, held, proxy):
    """The control: the same held request with keep-alives off is cut by the proxy (so the test above can fail)."""
    entered, release = held
    state = served[2].state["llminfer"]
    state.sse_keepalive_s = None
    outcome: dict = {}

    def call():
        try:
            r = httpx.post(proxy.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True})
            outcome["status"] = r.status_code
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    try:
        worker = threading.Thread(target=call)
        worker.start()
        assert proxy.wait_for(lambda: proxy.cuts > 0)
        release.set()
        worker.join(60)
    finally:
        state.sse_keepalive_s = KEEPALIVE_S
    assert isinstance(outcome.get("error"), httpx.RemoteProtocolError | httpx.ReadError), outcome
    served[1].wait_drained()
    assert served[1].cache_stats()["blocks_used"] == 0


# ---------------------------------------------------------------------------- OpenAPI document
BASE_BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 1},
}
# Values the schema cannot say (a grammar in its syntax, a served model's name, a tool definition).
VALUES = {
    "model": MODEL, "guided_regex": "[ab]", "guided_grammar": 'root ::= "a" | "b"', "guided_choice": ["a", "b"],
    "guided_json": {"type": "string", "enum": ["a"]}, "structured_outputs": {"choice": ["a", "b"]},
    "response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "auto", "logit_bias": {"5": 1.0},
    "text": {"format": {"type": "json_object"}}, "force_words": ["the"],
}
CHAT = "/v1/chat/completions"
NEEDS = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True},
         (CHAT, "tool_choice"): {"tools": TOOLS}, (CHAT, "parallel_tool_calls"): {"tools": TOOLS}}
# Advertised fields another change makes acceptable; listed so the test notices when they are (then remove).
KNOWN_REFUSED: set[tuple[str, str]] = set()  # (route, field) advertised but refused: none


def _value(schema: dict, components: dict):
    """A valid value of ``schema``: its lower bound for numbers (the edge the document promises), one item
    for arrays, every property for objects."""
    if "$ref" in schema:
        return _value(components[schema["$ref"].rsplit("/", 1)[1]], components)
    if "anyOf" in schema:
        return _value(next(s for s in schema["anyOf"] if s.get("type") != "null"), components)
    if "enum" in schema:
        return next(v for v in schema["enum"] if v is not None)
    kind = schema.get("type")
    if kind == "integer":
        return schema.get("minimum", schema.get("exclusiveMinimum", -1) + 1)
    if kind == "number":
        if "minimum" in schema:
            return schema["minimum"]
        low = schema.get("exclusiveMinimum", 0.0)
        return (low + schema.get("maximum", low + 1.0)) / 2
    if kind == "boolean":
        return True
    if kind == "string":
        return "a"
    if kind == "array":
        return [_value(schema.get("items", {"type": "string"}), components)] * max(1, schema.get("minItems", 1))
    if kind == "object":
        return {k: _value(v, components) for k, v in schema.get("properties", {}).items()}
    return "a"


def test_openapi_states_limits_and_streams(served):
    doc = httpx.get(served[0] + "/schema/openapi.json").json()
    components = doc["components"]["schemas"]

    def bounds(schema, field):
        (branch,) = [b for b in components[schema]["properties"][field]["anyOf"] if b.get("type") != "null"]
        return {k: v for k, v in branch.items() if "imum" in k or "Items" in k}

    assert bounds("ChatCompletionRequest", "temperature") == {"minimum": 0.0, "maximum": 2.0}
    assert bounds("ResponsesRequest", "temperature") == {"minimum": 0.0, "maximum": 2.0}
    assert bounds("ChatCompletionRequest", "top_p") == {"exclusiveMinimum": 0.0, "maximum": 1.0}
    assert bounds("ChatCompletionRequest", "top_logprobs") == {"minimum": 0, "maximum": 20}
    assert bounds("CompletionRequest", "logprobs") == {"minimum": 0, "maximum": 20}
    assert bounds("ChatCompletionRequest", "min_p") == {"minimum": 0.0, "maximum": 1.0}
    assert {"previous_response_id", "tools", "conversation"}.isdisjoint(components["ResponsesRequest"]["properties"])
    for path in BASE_BODIES:
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content), path
    assert "ChatCompletionChunk" in components


# Fields that change what a request is (a constraint, tools, streaming, echo, choices) go in a request of their
# own; the rest go together in one request per endpoint (each refusal names its field, so it is still clear).
ALONE = {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object",
         "structured_outputs", "tools", "tool_choice", "parallel_tool_calls", "text", "stream", "stream_options",
         "echo", "logprobs", "top_logprobs", "n", "best_of", "force_words", "bad_words"}


def _refused_fields(url: str, path: str, body: dict, fields: set[str]) -> dict[str, dict]:
    """Send ``body``; while it is refused, drop the field the error names and send again. Returns the refusals."""
    refused: dict[str, dict] = {}
    body = dict(body)
    while True:
        with httpx.Client(timeout=120) as http, http.stream("POST", url + path, json=body) as r:
            r.read()
        if r.status_code == 200:
            return refused
        error = r.json()["error"]
        field = (error.get("param") or "").split(".")[0].split("[")[0]
        assert r.status_code == 400 and field in fields - set(refused), (path, body, r.status_code, error)
        refused[field] = error
        body.pop(field)


def test_every_advertised_request_field_is_accepted(served):
    url = served[0]
    doc = httpx.get(url + "/schema/openapi.json").json()
    components = doc["components"]["schemas"]
    cases = []
    for path, base in BASE_BODIES.items():
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        together = dict(base)
        for field, schema in components[ref.rsplit("/", 1)[1]]["properties"].items():
            value = VALUES[field] if field in VALUES else _value(schema, components)
            if field in ALONE:
                needs = NEEDS.get((path, field), NEEDS.get(field, {}))
                cases.append((path, {**base, field: value, **needs}, {field}))
            elif field not in base:
                together[field] = value
        cases.append((path, together, set(together) - set(base)))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: (c[0], _refused_fields(url, *c)), cases))
    refused = {(path, field) for path, errors in results for field in errors}
    assert refused == KNOWN_REFUSED, [(p, r) for p, r in results if r]  # accepted now: remove from the list


# ---------------------------------------------------------------------------- guidellm
def _guidellm() -> str | None:
    """guidellm's command: ``$LLMINFER_GUIDELLM``, else next to this Python (the dev extra), else on PATH."""
    return (os.environ.get("LLMINFER_GUIDELLM") or shutil.which("guidellm", path=os.path.dirname(sys.executable))
            or shutil.which("guidellm"))


@pytest.mark.slow
def test_guidellm_benchmarks_the_server_with_its_default_health_check(served, tmp_path):
    exe = _guidellm()
    if exe is None:
        pytest.skip("guidellm is not installed (pip install 'llminfer[dev]')")
    url, engine, _ = served
    engine.tokenizer.save_pretrained(tmp_path / "tokenizer")  # guidellm counts tokens with it, offline
    out = tmp_path / "report.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": "1"}  # one request at a time needs one worker process
    run = subprocess.run(
        [exe, "run", "--backend", f"kind=openai_http,target={url},model={MODEL}", "--profile", "kind=synchronous",
         "--constraint", "kind=max_requests,count=3", "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
         "--tokenizer", f"kind=huggingface_auto,model={tmp_path / 'tokenizer'}", "--output",
         f"kind=json,path={out}", "--disable-console-interactive"],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    requests = bench["requests"]
    assert len(requests["successful"]) == 3 and not requests["errored"] and not requests["incomplete"]
    assert all(r["output_tokens"] == 8 and r["prompt_tokens"] > 0 for r in requests["successful"])
