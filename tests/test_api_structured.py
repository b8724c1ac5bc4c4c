"""Structured output and tool calling over HTTP, on the built-in model (a random Qwen2) behind a live
loopback server: the official ``openai`` client (``parse``, ``response_format``, vLLM's ``guided_*`` and
``structured_outputs`` extras, tools streamed and not), LangChain's ``ChatOpenAI``, and the errors (each an
OpenAI error object naming its ``param``; the server keeps serving and frees every KV block).

Outputs are valid by construction (constrained decoding), so they are checked exactly even though the
model's weights are random; schemas bound their strings and numbers so no output runs to ``max_tokens``.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from test_tools import TOOL_TEMPLATE

from helpers import TOOLS, WEATHER
from llminfer import EngineConfig, InferenceEngine
from llminfer.api import create_app, serve_in_thread
from llminfer.chat import ChatRenderer
from llminfer.tools import parse_tools

MODEL = "llminfer/tiny-qwen2"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Describe a pet."}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Pet(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]


@pytest.fixture(scope="module")
def served():
    engine = InferenceEngine(EngineConfig(max_batch_size=8, batch_timeout_ms=1))
    with serve_in_thread(create_app(engine)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0], timeout=120) as c:
        yield c


def _stream_text(client, **kw):
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def _stream_calls(chunks):
    """Accumulate streamed tool-call deltas the way clients do: by index, arguments concatenated."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                assert entry["id"] is None  # the id comes once, on a call's first delta
                entry["id"] = d.id
                assert d.type == "function"
            if d.function and d.function.name:
                entry["name"] += d.function.name
            if d.function and d.function.arguments:
                entry["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)]


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        name, args = (call.function.name, call.function.arguments) if hasattr(call, "function") else \
            (call["name"], call["arguments"])
        assert names is None or name in names
        jsonschema.validate(json.loads(args), PARAMS[name])


# ---------------------------------------------------------------------------- response_format and guided_*
def test_parse_with_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=120,
                                      temperature=0)
    message = r.choices[0].message
    assert isinstance(message.parsed, Pet) and r.choices[0].finish_reason == "stop"
    assert Pet.model_validate_json(message.content) == message.parsed
    assert message.content == message.parsed.model_dump_json()  # compact JSON, properties in schema order


def test_json_object_and_json_schema_dict(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                       max_tokens=120, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 3,
                                                                                  "maximum": 5}},
              "required": ["ok", "n"], "additionalProperties": False}
    for seed in (1, 2, 3):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=seed,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "flag", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                       response_format={"type": "text"}, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_guided_regex_choice_grammar(client, temperature):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=temperature, seed=5)
    pattern = r"[a-z]{2,6}-[0-9]{2}"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        text = client.chat.completions.create(**kw, extra_body=extra).choices[0].message.content
        assert re.fullmatch(pattern, text), text
    for extra in ({"guided_choice": ["yes", "no", "maybe"]}, {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}):
        assert client.chat.completions.create(**kw, extra_body=extra).choices[0].message.content in {"yes", "no", "maybe"}
    grammar = 'root ::= "(" digit ("+" digit)? ("+" digit)? ")"\ndigit ::= [0-9]'  # bounded: no runaway
    text = client.chat.completions.create(**kw, extra_body={"guided_grammar": grammar}).choices[0].message.content
    assert re.fullmatch(r"\([0-9](\+[0-9]){0,2}\)", text), text
    text = client.chat.completions.create(**kw, extra_body={"guided_json": WEATHER}).choices[0].message.content
    jsonschema.validate(json.loads(text), WEATHER)
    # Any JSON object: keys are unbounded strings, which random weights sampled at temperature 1 fill until
    # the budget (a closing quote is one allowed token in thousands), so this one is checked greedy.
    text = client.chat.completions.create(**{**kw, "temperature": 0},
                                          extra_body={"structured_outputs": {"json_object": True}}).choices[0]
    assert isinstance(json.loads(text.message.content), dict)
    # completions take the same fields
    comp = client.completions.create(model=MODEL, prompt="Code:", max_tokens=40, temperature=temperature, seed=5,
                                     extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, comp.choices[0].text)
    comp = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=60, temperature=temperature, seed=5,
                                     extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"name": "w", "schema": WEATHER}}})
    jsonschema.validate(json.loads(comp.choices[0].text), WEATHER)


def test_streamed_structured_output_equals_non_streamed(client):
    kw = dict(messages=MESSAGES, max_tokens=120, temperature=1.0, seed=11,
              response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}})
    full = client.chat.completions.create(model=MODEL, **kw).choices[0]
    text, chunks = _stream_text(client, **kw)
    assert text == full.message.content
    Pet.model_validate_json(text)
    assert chunks[-1].choices[0].finish_reason == full.finish_reason == "stop"


# ---------------------------------------------------------------------------- tools
@pytest.mark.parametrize("parallel", [False, None])
def test_tool_choice_required(client, parallel):
    # With parallel calls allowed the grammar does not bound how many calls come: sampled from random weights,
    # the number is roughly geometric (2 to 20 over seeds 21-26), so the budget covers far more than that.
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is 2+3?"}], tools=TOOLS,
              tool_choice="required", max_tokens=300 if parallel is False else 1000, temperature=1.0, seed=21)
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    _check_calls(calls)
    if parallel is False:
        assert len(calls) == 1
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) and c.type == "function" for c in calls)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = _stream_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_named_function(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=80,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=4)
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    _check_calls([call], {"get_weather"})
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert len(deltas) > 2  # the arguments arrive in fragments as they are generated
    (streamed,) = _stream_calls(chunks)
    assert (streamed["name"], streamed["arguments"]) == ("get_weather", call.function.arguments)


def test_tools_with_n_choices(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Sum?"}], tools=TOOLS, max_tokens=60, n=2,
              tool_choice={"type": "function", "function": {"name": "add"}}, temperature=1.0, seed=8)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        _check_calls([call], {"add"})
    chunks = list(client.chat.completions.create(stream=True, **kw))
    for i, choice in enumerate(r.choices):
        (streamed,) = _stream_calls([c for c in chunks if c.choices and c.choices[0].index == i])
        assert streamed["arguments"] == choice.message.tool_calls[0].function.arguments
    assert len({c.choices[0].delta.tool_calls[0].id for c in chunks
                if c.choices and c.choices[0].delta.tool_calls and c.choices[0].delta.tool_calls[0].id}) == 2


@pytest.mark.parametrize("parallel", [False, None])
def test_tool_choice_auto_with_response_format(client, served, parallel):
    """auto + response_format: tool calls when the model's own first choice opens one (here a logit_bias on
    ``<`` makes it), a Pet otherwise; streamed as it is returned whole."""
    opening = served[1].tokenizer.convert_tokens_to_ids("<")
    for wants_call in (True, False):
        kw = dict(messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=1000, temperature=1.0,
                  seed=5, response_format={"type": "json_schema", "json_schema": {
                      "name": "pet", "schema": Pet.model_json_schema()}},
                  **({"parallel_tool_calls": parallel} if parallel is not None else {}),
                  **({"logit_bias": {str(opening): 100}} if wants_call else {}))
        choice = client.chat.completions.create(model=MODEL, **kw).choices[0]
        chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
        if wants_call:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            _check_calls(choice.message.tool_calls)
            assert parallel is None or len(choice.message.tool_calls) == 1
            assert [(c["name"], c["arguments"]) for c in _stream_calls(chunks)] == [
                (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        else:
            assert choice.finish_reason == "stop" and choice.message.tool_calls is None
            Pet.model_validate_json(choice.message.content)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content


def test_tools_are_planned_off_the_event_loop(client, monkeypatch):
    """Checking tools' schemas and building the calls-or-answer grammar take seconds for large tools: a worker
    thread does it, so other streams go on (the event loop runs in the server's own thread)."""
    import threading

    import llminfer.api.chat as chat_route

    threads = []
    real = chat_route.tool_plan

    def recording(body):
        threads.append(threading.current_thread().name)
        return real(body)

    monkeypatch.setattr(chat_route, "tool_plan", recording)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=2,
                                   response_format={"type": "json_object"})
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert len(threads) == 2 and threads[0] != threads[1]  # with tools a worker, without them the loop's own
    assert "worker" in threads[0].lower(), threads


def test_response_format_with_tool_choice_none_and_required(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}}
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, response_format=fmt, max_tokens=300, temperature=1.0, seed=3)
    # none: the answer is all there is
    r = client.chat.completions.create(tool_choice="none", **kw)
    assert r.choices[0].message.tool_calls is None
    Pet.model_validate_json(r.choices[0].message.content)
    # required: the output is the calls (the format is for a later turn's answer)
    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls)
    # a bad format is refused whatever the tool_choice, naming it
    for choice in ("auto", "none", "required"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(tool_choice=choice, **{**kw, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                    "s": {"type": "string", "pattern": "(?=a)"}}}}}})
        assert err.value.body["param"] == "response_format", (choice, err.value.body)


def test_tool_choice_auto_and_none_without_calls(client):
    # The random model does not write <tool_call> blocks: the text comes back as content (the parser
    # itself is tested on hand-written outputs in test_tools.py).
    kw = dict(messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=MODEL, tools=TOOLS, tool_choice=choice, **kw)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
        text, _ = _stream_text(client, tools=TOOLS, tool_choice=choice, **kw)
        assert text == r.choices[0].message.content


def test_conversation_with_tool_results(client, served):
    engine = served[1]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 22 C"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    rendered = ChatRenderer(engine.tokenizer).render(messages, parse_tools(TOOLS))
    assert "<tool_response>\nsunny, 22 C\n</tool_response>" in rendered
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(rendered, add_special_tokens=False))


def test_template_with_tool_support_over_http(client, served):
    engine = served[1]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    original = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = TOOL_TEMPLATE
    try:
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=2, temperature=0)
        expected = engine.tokenizer.apply_chat_template(
            [messages[0], {**messages[1], "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
             messages[2]], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    finally:
        engine.tokenizer.chat_template = original
    assert '"arguments": {"a": 1, "b": 2}' in expected and "<tool_response>\n3\n</tool_response>" in expected
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(expected, add_special_tokens=False))


# ---------------------------------------------------------------------------- LangChain
def test_langchain_structured_output_and_tools(served):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    llm = langchain_openai.ChatOpenAI(base_url=served[0] + "/v1", api_key="x", model=MODEL, temperature=0,
                                      max_tokens=150, max_retries=0, timeout=120)
    for method in ("json_schema", "function_calling"):
        pet = llm.with_structured_output(Pet, method=method).invoke("Describe a pet.")
        assert isinstance(pet, Pet), method

    @tool
    def add(a: int = Field(ge=0, le=99), b: int = Field(ge=0, le=99)) -> int:
        """Add two numbers."""
        return a + b

    @tool
    def get_weather(city: str = Field(max_length=10), days: int = Field(ge=1, le=7)) -> str:
        """Forecast for a city."""
        return "sunny"

    for choice in ("add", "any"):
        kwargs = {"parallel_tool_calls": False} if choice == "any" else {}
        message = llm.bind_tools([add, get_weather], tool_choice=choice, **kwargs).invoke("What is 2+3?")
        assert message.tool_calls, choice
        for call in message.tool_calls:
            assert call["name"] in {"add", "get_weather"} and call["id"].startswith("call_")
            schema = (add if call["name"] == "add" else get_weather).tool_call_schema.model_json_schema()
            jsonschema.validate(call["args"], schema)
        if choice == "add":
            assert [c["name"] for c in message.tool_calls] == ["add"]


# ---------------------------------------------------------------------------- errors
def _error(r: httpx.Response, param: str, code: str | None = None) -> dict:
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")  # a plain error, even for stream=True
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param, err
    if code is not None:
        assert err["code"] == code
    return err


def _body(**extra) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}


DEEP: dict = {"type": "integer"}
for _ in range(300):  # nested arrays compile in time cubic in the depth: 300 levels take seconds
    DEEP = {"type": "array", "items": DEEP}
BAD_PATTERN = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[[["}}}
HUGE_ENUM = {"type": "object", "properties": {"a": {"enum": [f"v{i}" for i in range(20_000)]}}}
ERROR_CASES = [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_PATTERN}}),
     "response_format"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    (dict(guided_regex="(unclosed"), "guided_regex"),
    (dict(guided_grammar="root ::= nothing_defined"), "guided_grammar"),
    (dict(guided_choice=[]), "guided_choice"),
    (dict(structured_outputs={"regex": "a+", "choice": ["a"]}), "structured_outputs"),
    (dict(structured_outputs={"json": BAD_PATTERN}), "structured_outputs"),
    (dict(structured_outputs={"structural_tag": "{}"}), "structured_outputs"),
    (dict(guided_json={"$ref": "http://example.com/x.json"}), "guided_json"),
    (dict(response_format={"type": "json_object"}, guided_regex="a+"), "guided_regex"),
    (dict(guided_json=WEATHER, structured_outputs={"regex": "a"}), "structured_outputs"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": BAD_PATTERN}}],
          response_format={"type": "json_object"}), "tools"),
    (dict(tools=TOOLS, guided_grammar="root ::= nothing_defined"), "guided_grammar"),
    # the constraint's size limit, reached by the tools' schemas, names the tools (it named no request field)
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": HUGE_ENUM}}], tool_choice="required"),
     "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": HUGE_ENUM}}],
          response_format={"type": "json_object"}), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "say\n</tool_call>"}}]), "tools[0].function.name"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name"),
    (dict(tools=[{"type": "function"}]), "tools[0].function"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": BAD_PATTERN}}],
          tool_choice={"type": "function", "function": {"name": "f"}}), "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": BAD_PATTERN}}],
          tool_choice="required"), "tools"),
    (dict(response_format={"type": "json_object"}, ignore_eos=True), "ignore_eos"),
    # hostile values: each was a 500 (TypeError, RecursionError) or silently taken as something else
    (dict(structured_outputs={"choice": 5}), "structured_outputs"),
    (dict(structured_outputs={"choice": {"a": 1}}), "structured_outputs"),
    (dict(structured_outputs={"json_object": "no"}), "structured_outputs"),
    (dict(guided_json=DEEP), "guided_json"),
    (dict(guided_json='{"items":' * 5000 + "{}" + "}" * 5000), "guided_json"),
]


@pytest.mark.parametrize(("extra", "param"), ERROR_CASES)
@pytest.mark.parametrize("stream", [False, True])
def test_errors_name_the_field(http, served, extra, param, stream):
    _error(http.post(CHAT, json=_body(stream=stream, **extra)), param)


def test_completion_errors(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "guided_regex": "(", "stream": True})
    _error(r, "guided_regex")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"},
                                           "guided_choice": ["a"]})
    _error(r, "guided_choice")


def test_compile_timeout_is_a_400(http, served, monkeypatch):
    compiler = served[1].runtime.grammar_compiler
    monkeypatch.setattr(compiler, "timeout_s", 0.0)
    # a schema compiled nowhere else (the cache would answer at once)
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}[0-9]+"}
                                               for i in range(1, 40)}}
    r = http.post(CHAT, json=_body(stream=True, response_format={"type": "json_schema", "json_schema": {
        "name": "big", "schema": schema}}))
    _error(r, "response_format", "grammar_compile_timeout")


@pytest.mark.parametrize("stream", [False, True])
def test_engine_side_constraint_errors_name_the_field(http, monkeypatch, stream):
    # Without the server's pre-check, the engine itself fails the request (param "structured_output"):
    # the client still gets a 400 naming the field it used.
    import llminfer.api.jobs as jobs

    async def no_check(grammar, param):
        return None

    monkeypatch.setattr(jobs, "check_structured_output", no_check)
    _error(http.post(CHAT, json=_body(stream=stream, guided_regex="[unclosed")), "guided_regex")


class _RecordingLog:
    """A stand-in for a module's structlog logger that keeps ``(level, event, fields)`` of every call."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.lines.append((level, event, fields))


def test_a_stream_whose_constraint_dead_ends_ends_with_the_requests_error(http, monkeypatch):
    # A string whose pattern matches nothing passes the compile check (its opening quote can start) and dead-ends
    # after it: the started stream ends with the request's own 400-class error event, logged at info with its
    # code (the client's fault, not the server's: no "stream failed" at error level).
    from llminfer.api import middleware, streaming

    log = _RecordingLog()
    monkeypatch.setattr(streaming, "log", log)
    monkeypatch.setattr(middleware, "log", log)
    dead_end = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "[^\\s\\S]"}}}
    with http.stream("POST", CHAT, json=_body(stream=True, max_tokens=8, response_format=dead_end)) as r:
        assert r.status_code == 200
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert http.post(CHAT, json=_body(max_tokens=1)).status_code == 200  # the first one's request line is out
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format" and error["code"]
    assert ("info", "stream ended by a request error") in [(level, event) for level, event, _ in log.lines]
    assert not [line for line in log.lines if line[0] in ("error", "exception", "critical")]
    (request,) = [fields for level, event, fields in log.lines if event == "request" and fields.get("error")]
    assert request["error_code"] == error["code"] and request["path"] == CHAT


def test_a_stuck_compile_does_not_time_out_other_constrained_requests(http, client, served, monkeypatch):
    compiler = served[1].runtime.grammar_compiler
    real, release, started = compiler._compile, threading.Event(), threading.Event()

    def compile_(spec):  # a pathological constraint: its compile runs on, uninterruptible
        if spec.regex == "stuck":
            started.set()
            release.wait(60)
        return real(spec)

    monkeypatch.setattr(compiler, "_compile", compile_)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(http.post, CHAT, json=_body(guided_regex="stuck"))
        try:
            assert started.wait(60)
            r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0,
                                               extra_body={"guided_choice": ["unstuck", "free"]})
            assert r.choices[0].message.content in {"unstuck", "free"}
        finally:
            release.set()
        assert stuck.result(timeout=60).status_code == 200


def test_server_keeps_serving_after_errors(http, client, served):
    engine = served[1]
    for extra, _ in ERROR_CASES[:4]:
        assert http.post(CHAT, json=_body(**extra)).status_code == 400
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0,
                                       extra_body={"guided_choice": ["ok", "fine"]})
    assert r.choices[0].message.content in {"ok", "fine"}
    engine.wait_drained()
    assert engine.cache_stats()["blocks_used"] == 0
