"""The HTTP server with raw HTTP: every error class, disconnects, queue limits, request ids, health, metrics.

Each error test ends by checking that the server still serves. The server runs on loopback in a
background thread (small context and batch so the limits are cheap to reach).
"""

from __future__ import annotations

import contextlib
import json
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import wait_until
from llminfer import EngineConfig, EngineError, InferenceEngine
from llminfer.api import create_app, serve_in_thread

API_KEY = "sk-test-key"
MAX_MODEL_LEN = 256
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ABORTED = "llminfer_request_success_total"  # with finished_reason="abort"


@pytest.fixture(scope="module")
def server():
    engine = InferenceEngine(EngineConfig(max_batch_size=2, batch_timeout_ms=1, max_model_len=MAX_MODEL_LEN))
    app = create_app(engine, api_key=API_KEY, max_queue_size=1, served_model_name="tiny")
    with serve_in_thread(app) as url:
        yield url, app, engine


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server[0], headers=AUTH, timeout=60) as c:
        yield c


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    """Sum of all samples called ``name`` on /metrics whose labels include ``labels``."""
    text = client.get("/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


def assert_serves(client: httpx.Client) -> None:
    r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert err["type"] == type_
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def chat_body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}


# ---------------------------------------------------------------------------- 400: malformed, types, ranges
def test_malformed_json(client):
    r = client.post(CHAT, content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_json")
    r = client.post(CHAT, content=b"", headers={"content-type": "application/json"})
    assert_error(r, 400)
    r = client.post(CHAT, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert_serves(client)


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_body_over_the_limit_is_413(client, path):
    body = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * (11 * 2**20)}])).encode()
    assert_error(client.post(path, content=body, headers={"content-type": "application/json"}), 413,
                 code="request_too_large")
    assert_serves(client)


@pytest.mark.parametrize(("path", "field", "value"), [
    (CHAT, "temperature", "hot"),
    (CHAT, "max_tokens", 2.5),
    (CHAT, "stream", "yes"),
    (CHAT, "stop", 7),
    (CHAT, "messages", "hello"),
    (COMPLETIONS, "prompt", {"text": "x"}),
    (COMPLETIONS, "echo", "true"),
    (COMPLETIONS, "n", "2"),
])
def test_wrong_types_name_the_param(client, path, field, value):
    body = chat_body() if path == CHAT else {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    body[field] = value
    assert_error(client.post(path, json=body), 400, param=field)
    assert_serves(client)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 2.5), ("temperature", -0.1), ("top_p", 1.5), ("top_p", 0), ("n", 0), ("n", 1000),
    ("max_tokens", 0), ("max_completion_tokens", -3), ("presence_penalty", 3), ("frequency_penalty", -2.5),
    ("seed", 2**70), ("top_logprobs", 50), ("top_k", -5), ("min_p", 1.5), ("repetition_penalty", 0),
    ("repetition_penalty", 1e-300),
    ("no_repeat_ngram_size", -1),
])
def test_out_of_range_names_the_param(client, field, value):
    body = chat_body(**{field: value})
    if field == "top_logprobs":
        body["logprobs"] = True
    assert_error(client.post(CHAT, json=body), 400, param=field)
    assert_serves(client)


def test_extreme_but_valid_values_are_served(client):
    # A vanishing temperature is greedy (dividing logits by it would overflow).
    greedy = client.post(CHAT, json=chat_body(temperature=0, max_tokens=6, ignore_eos=True)).json()
    tiny = client.post(CHAT, json=chat_body(temperature=1e-300, max_tokens=6, ignore_eos=True))
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"] == greedy["choices"][0]["message"]
    r = client.post(CHAT, json=chat_body(top_p=1e-300, top_k=2**31 - 1, seed=-(2**63), n=3, temperature=2,
                                         no_repeat_ngram_size=64, repetition_penalty=10, min_p=1.0))
    assert r.status_code == 200, r.text
    assert_serves(client)


def test_engine_side_validation_names_the_param(client):
    # Values msgspec accepts but the engine refuses (an empty stop string, a blank bad word).
    assert_error(client.post(CHAT, json=chat_body(stop=[""])), 400, param="stop")
    assert_error(client.post(CHAT, json=chat_body(bad_words=["  "])), 400, param="bad_words")
    assert_serves(client)


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
])
def test_bad_messages(client, messages, param):
    assert_error(client.post(CHAT, json={"model": "tiny", "messages": messages}), 400, param=param)
    assert_serves(client)


def test_missing_required_fields(client):
    assert_error(client.post(CHAT, json={"model": "tiny"}), 400, param="messages")
    assert_error(client.post(COMPLETIONS, json={"model": "tiny"}), 400, param="prompt")
    assert_serves(client)


@pytest.mark.parametrize(("prompt", "param"), [
    ([], "prompt"), ([1, "a"], "prompt"), ([[1, 2], []], "prompt[1]"), ([10**9], "prompt"), ([-1], "prompt[0]"),
    ("", "prompt"),
])
def test_bad_prompts(client, prompt, param):
    assert_error(client.post(COMPLETIONS, json={"model": "tiny", "prompt": prompt}), 400, param=param)
    assert_serves(client)


@pytest.mark.parametrize(("body", "param"), [
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"logit_bias": {"x42": 5}}, "logit_bias"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_unsupported_completion_options(client, body, param):
    r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": "Hi", **body})
    assert_error(r, 400, param=param)
    assert_serves(client)


def test_unsupported_chat_options(client):
    assert_error(client.post(CHAT, json=chat_body(top_logprobs=2)), 400, param="top_logprobs")
    # tools and response_format are supported (test_api_structured.py); malformed ones are refused
    assert_error(client.post(CHAT, json=chat_body(tools=[{"type": "function"}])), 400, param="tools[0].function")
    assert_error(client.post(CHAT, json=chat_body(response_format={"type": "xml"})), 400,
                 param="response_format")
    # a schema without "type" was read as plain text and the schema dropped
    assert_error(client.post(CHAT, json=chat_body(response_format={"json_schema": {"name": "x", "schema": {}}})), 400,
                 param="response_format.type", code="missing_required_parameter")
    assert_serves(client)


# ---------------------------------------------------------------------------- context length
@pytest.mark.parametrize("stream", [False, True])
def test_prompt_too_long(client, stream):
    long_text = "word " * (MAX_MODEL_LEN + 10)
    r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": long_text, "stream": stream})
    err = assert_error(r, 400, param="prompt", code="context_length_exceeded")
    assert str(MAX_MODEL_LEN) in err["message"]
    assert "data:" not in r.text
    r = client.post(CHAT, json=chat_body(messages=[{"role": "user", "content": long_text}], stream=stream))
    assert_error(r, 400, param="messages", code="context_length_exceeded")
    # Token-id prompts too, and a prompt that fits but not with the requested completion length.
    r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": [5] * MAX_MODEL_LEN, "stream": stream})
    assert_error(r, 400, code="context_length_exceeded")
    r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": [5] * 200, "max_tokens": 100, "stream": stream})
    assert_error(r, 400, code="context_length_exceeded")
    # truncate_prompt_tokens cuts a token-id prompt before its length is checked, as it cuts a text prompt
    for prompt in ([5] * (MAX_MODEL_LEN + 10), long_text):
        r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": stream,
                                           "truncate_prompt_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
        if not stream:
            assert r.json()["usage"]["prompt_tokens"] == 8
    assert_serves(client)


def test_max_tokens_null_fills_the_context(client):
    r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": [5] * 200, "max_tokens": None,
                                       "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == MAX_MODEL_LEN


# ---------------------------------------------------------------------------- 404 / 405 / 401
def test_unknown_model(client):
    assert_error(client.post(CHAT, json=chat_body(model="gpt-17")), 404, param="model", code="model_not_found")
    assert_error(client.get("/v1/models/gpt-17"), 404, code="model_not_found")
    assert_serves(client)


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing-here"), 404)
    assert_error(client.get(CHAT), 405)
    assert_serves(client)


def test_api_key(server, client):
    url = server[0]
    with httpx.Client(base_url=url, timeout=30) as anon:
        assert_error(anon.post(CHAT, json=chat_body()), 401, code="invalid_api_key")
        r = anon.post(CHAT, json=chat_body(), headers={"Authorization": "Bearer wrong"})
        assert_error(r, 401, code="invalid_api_key")
        # Authentication comes before body validation: garbage without a key is still a 401.
        assert_error(anon.post(CHAT, content=b"{garbage", headers={"content-type": "application/json"}), 401)
        assert_error(anon.get("/v1/models"), 401)
        # Health, metrics and the OpenAPI document stay open.
        assert anon.get("/healthz").status_code == 200
        assert anon.get("/metrics").status_code == 200
        assert anon.get("/schema/openapi.json").status_code == 200
    assert_serves(client)


# ---------------------------------------------------------------------------- 429
def test_queue_full_gives_429_with_retry_after(server, client):
    _, app, engine = server
    state = app.state["llminfer"]
    results: list[int] = []

    def long_request() -> None:
        r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": "Hi", "max_tokens": 64, "ignore_eos": True,
                                           "temperature": 0})
        results.append(r.status_code)

    # max_batch_size 2 + max_queue_size 1: three engine requests fit, the fourth is refused.
    threads = [threading.Thread(target=long_request) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        assert wait_until(lambda: state.in_flight == 3, timeout_s=10)
        rejected_before = metric(client, "llminfer_requests_rejected_total")
        r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert_error(r, 429, type_="rate_limit_error", code="rate_limit_exceeded")
        assert int(r.headers["retry-after"]) >= 1
        # n counts: two choices do not fit either.
        r = client.post(CHAT, json=chat_body(n=2))
        assert r.status_code == 429
        assert metric(client, "llminfer_requests_rejected_total") == rejected_before + 2
    finally:
        for t in threads:
            t.join(timeout=60)
    assert results == [200, 200, 200]
    assert state.in_flight == 0
    assert_serves(client)


# ---------------------------------------------------------------------------- 500, mid-stream failure
def test_internal_failure_is_a_500_error_object(server, client, monkeypatch):
    _, _, engine = server

    async def broken(request):
        raise RuntimeError("simulated bug")
        yield  # pragma: no cover

    monkeypatch.setattr(engine, "generate_request", broken)
    r = client.post(CHAT, json=chat_body())
    assert_error(r, 500, type_="server_error")
    assert "simulated bug" not in r.json()["error"]["message"]  # no internals leak to the client
    r = client.post(CHAT, json=chat_body(stream=True))
    assert_error(r, 500, type_="server_error")
    monkeypatch.undo()
    assert_serves(client)


def _fail_after_two_chunks(engine, monkeypatch) -> None:
    """Make ``engine.generate_request`` raise an EngineError after its second chunk (undo with monkeypatch)."""
    real = engine.generate_request

    async def flaky(request):
        async with contextlib.aclosing(real(request)) as chunks:
            n = 0
            async for chunk in chunks:
                yield chunk
                n += 1
                if n == 2:
                    raise EngineError("simulated backend failure")

    monkeypatch.setattr(engine, "generate_request", flaky)


def test_engine_failure_mid_stream_sends_error_event_then_done(server, client, monkeypatch):
    _, app, engine = server
    _fail_after_two_chunks(engine, monkeypatch)
    with client.stream("POST", CHAT, json=chat_body(max_tokens=20, ignore_eos=True, stream=True)) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    monkeypatch.undo()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "simulated backend failure" in error["message"]
    engine.wait_drained()
    assert engine.cache_stats()["blocks_used"] == 0
    assert wait_until(lambda: app.state["llminfer"].in_flight == 0)
    assert_serves(client)


def test_responses_stream_failing_mid_way_ends_with_typed_error_events_and_no_done(server, client, monkeypatch):
    """The Responses API's own way to fail a started stream: an ``error`` event, then ``response.failed``
    carrying the error, with sequence numbers that go on from the events sent; no ``[DONE]`` (it has none)."""
    _, app, engine = server
    _fail_after_two_chunks(engine, monkeypatch)
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 20, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    monkeypatch.undo()
    events = [(lines[i].removeprefix("event: "), json.loads(lines[i + 1].removeprefix("data: ")))
              for i in range(0, len(lines), 2)]
    assert "data: [DONE]" not in lines
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(kind == data["type"] for kind, data in events)
    (error_kind, error), (failed_kind, failed) = events[-2:]
    assert error_kind == "error" and error["code"] and "simulated backend failure" in error["message"]
    assert failed_kind == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": error["code"], "message": error["message"]}
    engine.wait_drained()
    assert engine.cache_stats()["blocks_used"] == 0
    assert wait_until(lambda: app.state["llminfer"].in_flight == 0)
    assert_serves(client)


# ---------------------------------------------------------------------------- disconnects
def test_disconnect_non_streaming_cancels_the_request(server, client):
    url, app, engine = server
    aborted_before = metric(client, ABORTED, finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + COMPLETIONS, headers=AUTH, timeout=httpx.Timeout(60, read=0.4),
                   json={"model": "tiny", "prompt": "Hi", "max_tokens": 250, "ignore_eos": True})
    engine.wait_drained()
    assert engine.cache_stats()["blocks_used"] == 0 and engine.scheduler_stats()["running"] == 0
    assert wait_until(lambda: app.state["llminfer"].in_flight == 0, timeout_s=5)
    assert metric(client, ABORTED, finished_reason="abort") == aborted_before + 1
    assert_serves(client)


def test_disconnect_streaming_cancels_the_request(server, client):
    _, app, engine = server
    aborted_before = metric(client, ABORTED, finished_reason="abort")
    with client.stream("POST", CHAT, json=chat_body(max_tokens=200, ignore_eos=True, stream=True, n=2)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    # Leaving the block closes the connection half-way through the stream.
    engine.wait_drained()
    assert engine.cache_stats()["blocks_used"] == 0 and engine.scheduler_stats()["running"] == 0
    assert wait_until(lambda: app.state["llminfer"].in_flight == 0, timeout_s=5)
    assert metric(client, ABORTED, finished_reason="abort") == aborted_before + 2
    assert_serves(client)


# ---------------------------------------------------------------------------- ids, health, metrics, docs
def test_request_id_is_echoed_or_made(client):
    r = client.post(CHAT, json=chat_body(), headers={"x-request-id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    r = client.post(CHAT, json=chat_body(model="nope"), headers={"x-request-id": "trace-43"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "trace-43"
    assert client.get("/v1/nothing", headers={"x-request-id": "trace-44"}).headers["x-request-id"] == "trace-44"
    made = client.post(CHAT, json=chat_body()).headers["x-request-id"]
    assert made and made != "trace-42"
    # A header that is not a sane token is replaced, not echoed.
    assert client.get("/healthz", headers={"x-request-id": "a b"}).headers["x-request-id"] != "a b"


def test_health_models_metrics_and_openapi(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == "tiny" and card["object"] == "model" and card["owned_by"] and card["created"] > 0
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert client.get("/v1/models/llminfer/tiny-qwen2").json()["id"] == "tiny"  # the model id works too
    text = client.get("/metrics").text
    for name in ("llminfer_num_requests_running", "llminfer_num_requests_waiting", "llminfer_kv_blocks_used",
                 "llminfer_prefix_cache_hit_rate", "llminfer_time_to_first_token_seconds_bucket",
                 "llminfer_time_per_output_token_seconds_bucket", "llminfer_e2e_request_latency_seconds_bucket",
                 "llminfer_prompt_tokens_total", "llminfer_generation_tokens_total",
                 "llminfer_request_success_total", "llminfer_requests_rejected_total",
                 "llminfer_kv_cache_usage_perc"):
        assert name in text, name
    doc = client.get("/schema/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(doc["paths"])


def test_two_apps_in_one_process_have_separate_metrics():
    a = create_app(EngineConfig())
    b = create_app(EngineConfig())
    assert a.state["llminfer"].metrics.registry is not b.state["llminfer"].metrics.registry
