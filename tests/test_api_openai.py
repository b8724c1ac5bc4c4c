"""The HTTP server with the official ``openai`` client on loopback: chat and completions, streaming and
not, n, stop strings, include_usage, logprobs, seed, and streamed == non-streamed text."""

from __future__ import annotations

import math

import openai
import pytest

from llminfer import EngineConfig, InferenceEngine
from llminfer.api import create_app, serve_in_thread

MODEL = "llminfer/tiny-qwen2"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def served():
    engine = InferenceEngine(EngineConfig(max_batch_size=16, batch_timeout_ms=1))
    with serve_in_thread(create_app(engine)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def engine(served):
    return served[1]


def _chat_stream(client, **kw):
    return list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kw))


def _joined(chunks, index=0):
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


# ---------------------------------------------------------------------------- shapes
def test_chat_completion_shape_and_prompt(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL and r.created > 0
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert isinstance(choice.message.content, str) and choice.message.content
    # The prompt is the chat template with the generation prompt, tokenized once.
    tok = engine.tokenizer
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_content_parts_equal_plain_text(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colours."}]}]
    plain = [{"role": "user", "content": "Name three\ncolours."}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, **GREEDY)
    b = client.chat.completions.create(model=MODEL, messages=plain, max_tokens=6, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_completion_shape_and_prompt_forms(client, engine):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, **GREEDY)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    ids = engine.tokenizer.encode("Once upon a time")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == r.choices[0].text
    many = client.completions.create(model=MODEL, prompt=["Once upon a time", "Hello"], max_tokens=5, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == r.choices[0].text
    assert many.usage.prompt_tokens == len(ids) + len(engine.tokenizer.encode("Hello"))
    many_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=5, **GREEDY)
    assert [c.text for c in many_ids.choices] == [r.choices[0].text] * 2


def test_completion_echo(client):
    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, echo=True, **GREEDY)
    assert echoed.choices[0].text == "Hello there" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=4, echo=True, stream=True, **GREEDY) if c.choices)
    assert streamed == echoed.choices[0].text


def test_models(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.object == "model" and card.owned_by
    assert client.models.retrieve(MODEL).id == MODEL


# ---------------------------------------------------------------------------- streaming
def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, **GREEDY)
    chunks = _chat_stream(client, max_tokens=24, **GREEDY)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finals = [c for c in chunks if c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0] is chunks[-1] and finals[0].choices[0].finish_reason == "length"
    assert _joined(chunks) == full.choices[0].message.content
    assert all(c.usage is None for c in chunks)


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt="The weather today", max_tokens=24, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="The weather today", max_tokens=24, stream=True,
                                            **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks].count("length") == 1
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_include_usage(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, **GREEDY)
    chunks = _chat_stream(client, max_tokens=10, stream_options={"include_usage": True}, **GREEDY)
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 10
    comp = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True,
                                          stream_options={"include_usage": True}, **GREEDY))
    assert [c.usage is not None for c in comp] == [False] * (len(comp) - 1) + [True]
    assert comp[-1].choices == [] and comp[-1].usage.completion_tokens == 3


# ---------------------------------------------------------------------------- n, seed, stop
def test_n_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=7, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1]
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **GREEDY)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt is counted once
    assert 2 <= r.usage.completion_tokens <= 12
    assert r.choices[0].message.content != r.choices[1].message.content  # seed 7 and seed 8
    chunks = _chat_stream(client, max_tokens=6, n=2, seed=7, temperature=1.0)
    for i in (0, 1):
        mine = [c for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in mine].count(None) == len(mine) - 1
        assert _joined(chunks, i) == r.choices[i].message.content
    comp = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=3, n=2, **GREEDY)
    assert [c.index for c in comp.choices] == [0, 1, 2, 3]
    assert comp.choices[0].text == comp.choices[1].text  # greedy: the same prompt gives the same text


def test_seed_reproducible(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, top_p=0.95)
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=999, **kw).choices[0].message.content
    assert a == b and a != c
    streamed = _joined(_chat_stream(client, seed=1234, max_tokens=8, temperature=1.0, top_p=0.95))
    assert streamed == a


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client, stream):
    base = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=20, **GREEDY).choices[0].text
    stop = base[8:11]
    expected = base[: base.find(stop)]

    def run(stop_arg):
        if not stream:
            c = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=20, stop=stop_arg,
                                          **GREEDY).choices[0]
            return c.text, c.finish_reason
        chunks = list(client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=20,
                                                stop=stop_arg, stream=True, **GREEDY))
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    assert run(stop) == (expected, "stop")
    assert run(["never-appears", stop]) == (expected, "stop")
    chat_base = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, **GREEDY)
    text = chat_base.choices[0].message.content
    chat_stop = text[6:9]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, stop=chat_stop, **GREEDY)
    assert r.choices[0].message.content == text[: text.find(chat_stop)]
    assert r.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------- logprobs
def test_chat_logprobs(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=3,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token or "\ufffd" in entry.token
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, rel_tol=1e-5, abs_tol=1e-5)
        assert all(a.logprob >= b.logprob for a, b in zip(entry.top_logprobs, entry.top_logprobs[1:]))
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace") == \
        r.choices[0].message.content
    no_top = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, **GREEDY)
    assert [e.top_logprobs for e in no_top.choices[0].logprobs.content] == [[], [], []]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, **GREEDY)
    assert plain.choices[0].logprobs is None
    chunks = _chat_stream(client, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, logprobs=2,
                                            stream=True, **GREEDY))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


# ---------------------------------------------------------------------------- extras and errors
def test_llminfer_extras_pass_through(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    base = client.chat.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].message.content
    r = client.chat.completions.create(**kw, presence_penalty=1.5, frequency_penalty=0.5, extra_body={
        "ignore_eos": True, "top_k": 5, "min_p": 0.0, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2,
        "bad_words": [base.split()[0]] if base.split() else ["zzz"]})
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content != base
    forced = client.chat.completions.create(**kw, extra_body={"ignore_eos": True, "force_words": ["blue"]})
    assert "blue" in forced.choices[0].message.content


def test_client_sees_openai_errors(client, engine):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=9)
    assert err.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="word " * 3000, stream=True)
    assert err.value.code == "context_length_exceeded"
    # A stream the client abandons frees its KV blocks.
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=400, stream=True, **GREEDY)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    engine.wait_drained()
    assert engine.cache_stats()["blocks_used"] == 0
