"""``POST /tokenize`` and ``POST /detokenize`` on a live server on loopback: counts equal the ``prompt_tokens`` the
generation routes report for the same prompt or chat, text round-trips, and bad bodies get OpenAI errors."""

from __future__ import annotations

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llminfer import EngineConfig, InferenceEngine
from llminfer.api import create_app, serve_in_thread

MODEL = "llminfer/tiny-qwen2"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def served():
    engine = InferenceEngine(EngineConfig(max_batch_size=4, batch_timeout_ms=1))
    with serve_in_thread(create_app(engine)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0], timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_prompt_count_is_what_completions_report(http, client, served):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "The capital of France is",
                                     "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0)
    assert body["count"] == len(body["tokens"]) == done.usage.prompt_tokens
    assert body["max_model_len"] == served[1].max_model_len
    assert body["token_strs"] == served[1].tokenizer.convert_ids_to_tokens(body["tokens"])
    plain = http.post("/tokenize", json={"prompt": "The capital of France is", "add_special_tokens": False}).json()
    assert plain["tokens"] == served[1].tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert plain["token_strs"] is None


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_count_is_what_chat_completions_report(http, client, tools):
    body = {"model": MODEL, "messages": MESSAGES, **({"tools": tools} if tools else {})}
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    # vLLM's defaults for a chat, sent explicitly, change nothing
    same = http.post("/tokenize", json={**body, "add_special_tokens": False, "add_generation_prompt": True})
    assert same.json() == r.json()
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0,
                                          **({"tools": tools} if tools else {}))
    assert r.json()["count"] == done.usage.prompt_tokens


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=40))
def test_detokenize_inverts_tokenize(http, text):
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    if r.status_code == 400:  # text that tokenizes to nothing (the route refuses an empty prompt, as completions do)
        assert r.json()["error"]["param"] == "prompt"
        return
    ids = r.json()["tokens"]
    back = http.post("/detokenize", json={"tokens": ids})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": text}


def test_detokenize_keeps_special_tokens_and_accepts_nothing(http, served):
    eos = served[1].tokenizer.eos_token_id
    assert http.post("/detokenize", json={"tokens": [eos]}).json()["prompt"] == served[1].tokenizer.eos_token
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, 400, "tools"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "nope"}]}, 400, "tools[0]"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "a</tool_call>"}}]},
     400, "tools[0].function.name"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_bodies_get_openai_errors(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert error["message"]


def test_api_key_is_required_when_set():
    engine = InferenceEngine(EngineConfig(max_batch_size=2, batch_timeout_ms=1))
    with serve_in_thread(create_app(engine, api_key="sekret")) as url, httpx.Client(base_url=url, timeout=60) as c:
        assert c.post("/tokenize", json={"prompt": "a"}).status_code == 401
        assert c.post("/detokenize", json={"tokens": [1]}).status_code == 401
        ok = c.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["count"] >= 1
