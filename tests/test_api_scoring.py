"""Scoring and the request fields real clients send: prompt logprobs (engine, exact vs Hugging Face),
``echo`` + ``logprobs`` + ``max_tokens: 0`` (lm-eval's loglikelihood request), vLLM's ``prompt_logprobs``,
``logit_bias``, ``best_of``, ``suffix``, vLLM's extras, the unknown-field policy, logprob maps that never
lose an entry, stop-token text never output, and chat messages without content."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import structlog
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from helpers import make_engine, random_prompts
from llminfer import EngineConfig, InferenceEngine
from llminfer.api import create_app, serve_in_thread
from llminfer.api import protocol as s
from llminfer.api.logprobs import TokenText, completion_logprobs, top_map
from llminfer.core.scheduler import Scheduler, SchedulerLimits
from llminfer.kv.manager import KVCacheManager
from llminfer.protocols.messages import StepOutput, TokenizedRequest
from llminfer.request import Request
from llminfer.results import TokenLogprob
from llminfer.sampling.params import SamplingParams

MODEL = "llminfer/tiny-qwen2"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
TOL = 1e-4  # batched paged attention vs a plain forward, both fp32


# ---------------------------------------------------------------------------- engine: prompt logprobs
def test_prompt_logprobs_match_hf_forward_and_skip_the_prefix_cache(qwen2_dir):
    """Prompt logprobs equal a plain Hugging Face forward's log_softmax (fp32), through a chunked prefill
    (8-token budget over a 21-token prompt), and a repeat of the prompt, whose blocks are cached by then,
    takes no prefix-cache hit and gives the same numbers."""
    engine = make_engine(qwen2_dir, block_size=4, max_num_batched_tokens=8)
    model = AutoModelForCausalLM.from_pretrained(str(qwen2_dir), dtype=torch.float32, attn_implementation="sdpa")
    vocab = model.config.vocab_size
    (prompt,) = random_prompts([21], vocab, seed=5)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    with engine:
        first = engine.run(prompt, max_new_tokens=1, prompt_logprobs=3)
        again = engine.run(prompt, max_new_tokens=1, prompt_logprobs=3)
        plain = engine.run(prompt, max_new_tokens=1)  # no prompt logprobs: it may use the cache
        # Generate greedily, then score prompt + generated: each generated token's logprob is its score.
        gen = engine.run(prompt[:9], max_new_tokens=6, logprobs=2, ignore_eos=True)
        scored = engine.run(prompt[:9] + list(gen.token_ids), max_new_tokens=1, prompt_logprobs=2)
    tail = scored.prompt_logprobs[-6:]
    assert [e.token_id for e in tail] == list(gen.token_ids)
    assert [e.logprob for e in tail] == pytest.approx([e.logprob for e in gen.logprobs], abs=TOL)
    assert [[t for t, _ in e.top] for e in tail] == [[t for t, _ in e.top] for e in gen.logprobs]
    assert all(e.rank == 1 for e in tail)  # greedy: each was the most likely token
    assert len(first.prompt_logprobs) == len(prompt) - 1
    for pos, entry in enumerate(first.prompt_logprobs, start=1):
        row = ref[pos - 1]
        assert entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(float(row[prompt[pos]]), abs=TOL)
        value = row[prompt[pos]]  # a flat random-weight distribution: the rank within the tolerance
        assert int((row > value + TOL).sum()) + 1 <= entry.rank <= int((row > value - TOL).sum()) + 1
        top_ids = torch.topk(row, 3).indices.tolist()
        assert [t for t, _ in entry.top] == top_ids
        assert entry.top[0][1] == pytest.approx(float(row[top_ids[0]]), abs=TOL)
    assert again.stats.cached_tokens == 0
    assert [e.logprob for e in again.prompt_logprobs] == pytest.approx([e.logprob for e in first.prompt_logprobs],
                                                                        abs=TOL)
    assert plain.stats.cached_tokens > 0 and plain.prompt_logprobs == ()


def test_prompt_logprobs_with_speculative_decoding(qwen2_dir):
    """With drafts in the same packed step (a decoding request next to the prefill), the speculative
    backend finds the prompt rows too: the numbers equal a plain forward's."""
    engine = make_engine(qwen2_dir, block_size=4, max_num_batched_tokens=16, assistant_model_name=str(qwen2_dir),
                         speculative_num_assistant_tokens=3, speculative_confidence_threshold=0.0)
    model = AutoModelForCausalLM.from_pretrained(str(qwen2_dir), dtype=torch.float32, attn_implementation="sdpa")
    decoding, prompt = random_prompts([5, 30], model.config.vocab_size, seed=8)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    with engine:
        _, scored = engine.run_requests([
            engine.make_request(decoding, max_new_tokens=12, ignore_eos=True),
            engine.make_request(prompt, max_new_tokens=2, prompt_logprobs=1)])
    assert [e.token_id for e in scored.prompt_logprobs] == prompt[1:]
    assert [e.logprob for e in scored.prompt_logprobs] == pytest.approx(
        [float(ref[p - 1, prompt[p]]) for p in range(1, len(prompt))], abs=TOL)


def test_prompt_logprobs_kept_once_per_position():
    """A request recomputed after a preemption gets its prompt rows again: each position is kept once."""

    req = Request(request_id="r", token_ids=[1] * 7, num_prompt_tokens=7, params=SamplingParams(prompt_logprobs=1),
                  arrival_ns=0, max_tokens_total=8)
    entries = tuple(TokenLogprob(i, -float(i)) for i in range(1, 7))
    req.collect_prompt_logprobs(1, entries[:3])  # positions 1..3
    req.collect_prompt_logprobs(1, entries[:5])  # recomputed from the start: 4 and 5 are new
    req.collect_prompt_logprobs(6, entries[5:])
    assert [e.token_id for e in req.prompt_logprobs] == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------------- the live server
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
def http(served):
    with httpx.Client(base_url=served[0] + "/v1", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tok(served):
    return served[1].tokenizer


def _error(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    return err


def test_scored_prompt_matches_generation(client, http, tok):
    """echo + max_tokens 0 + logprobs scores the prompt: at each position the distribution is the one the
    model samples from when it generates after that prefix, and the numbers equal vLLM's prompt_logprobs."""
    ids = tok.encode("The quick brown fox jumps over")
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    (choice,) = scored.choices
    lp = choice.logprobs
    assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    assert len(lp.tokens) == len(ids) and lp.tokens == [tok.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert all(isinstance(v, float) and v < 0 for v in lp.token_logprobs[1:])
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert [choice.text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    for j in (2, len(ids) - 1):
        gen = client.completions.create(model=MODEL, prompt=ids[:j], max_tokens=1, logprobs=2, **GREEDY)
        assert gen.choices[0].logprobs.top_logprobs[0] == pytest.approx(lp.top_logprobs[j], abs=TOL)
    vllm = http.post("/completions", json={"prompt": ids, "max_tokens": 0, "prompt_logprobs": 0}).json()
    pl = vllm["choices"][0]["prompt_logprobs"]
    assert [e[str(i)]["logprob"] for e, i in zip(pl[1:], ids[1:])] == pytest.approx(lp.token_logprobs[1:], abs=TOL)


def test_echo_logprobs_then_generated_and_prompt_shapes(client, http, tok):
    """echo + max_tokens > 0: the prompt's logprobs, then the generated tokens' (lm-eval's request: it
    drops the last one); prompts as text, a list of texts and token-id lists; n > 1 repeats the prompt part."""
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2, echo=True, logprobs=1, **GREEDY)
    lp = r.choices[0].logprobs
    p = len(tok.encode("Hello there"))
    assert len(lp.tokens) == p + 2 and lp.token_logprobs[0] is None and None not in lp.token_logprobs[1:]
    assert r.choices[0].text.startswith("Hello there") and lp.text_offset[p] == len("Hello there")
    for prompt in (["Hello there", "Good morning all"], [tok.encode("Hello there"), tok.encode("Good morning all")]):
        body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0, "n": 2}
        choices = http.post("/completions", json=body).json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        for c, text in zip(choices, ["Hello there", "Hello there", "Good morning all", "Good morning all"]):
            assert c["text"].startswith(text)
            assert len(c["logprobs"]["tokens"]) == len(tok.encode(text)) + 1
        assert choices[0]["logprobs"]["token_logprobs"][:-1] == choices[1]["logprobs"]["token_logprobs"][:-1]


def test_text_offsets_count_characters_across_split_tokens(http, tok):
    """A character split over byte tokens shifts no later offset: each offset is where its token's text
    starts in the echoed text (tokens that continue a split character point at that character)."""
    text = "h\u00e9llo \u4e16\u754c \U0001f438!"
    body = {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1}
    lp = http.post("/completions", json=body).json()["choices"][0]["logprobs"]
    offsets = lp["text_offset"]
    assert len(offsets) == len(tok.encode(text)) > len(text) - 3  # some characters span several tokens
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] == len(text) - 1  # "!" is last
    for token, offset in zip(lp["tokens"], offsets):
        if not token.startswith("bytes:") and "\ufffd" not in token:
            assert text[offset:].startswith(token), (token, offset)


def test_vllm_prompt_logprobs_and_streamed_echo(http, tok):
    ids = tok.encode("One two three four")
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}
    (choice,) = http.post("/completions", json=body).json()["choices"]
    pl = choice["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for pos, entry in enumerate(pl[1:], start=1):
        assert str(ids[pos]) in entry and entry[str(ids[pos])]["rank"] >= 1
        assert entry[str(ids[pos])]["decoded_token"] == tok.decode([ids[pos]])
        assert {v["rank"] for v in entry.values()} >= {1, 2}  # the top 2 are there
    # Streamed: the opening chunk carries the echoed prompt with its logprobs, the same as the JSON answer.
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    plain = http.post("/completions", json=body).json()["choices"][0]
    with http.stream("POST", "/completions", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]
    assert chunks[0]["text"] == plain["text"] and chunks[0]["logprobs"] == plain["logprobs"]
    assert chunks[-1]["finish_reason"] == "length" and "".join(c["text"] for c in chunks) == plain["text"]


def test_logit_bias(client, http, tok, served):
    target = tok.encode(" banana")[0]
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logit_bias={str(target): 100}, **GREEDY)
    assert r.choices[0].text == tok.decode([target] * 3)
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=0, temperature=0)
    banned = tok.encode(r.choices[0].text)[0]
    r2 = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logit_bias={str(banned): -100},
                                   temperature=0)
    assert tok.encode(r2.choices[0].text)[0] != banned
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       logit_bias={str(target): 100}, **GREEDY)
    assert c.choices[0].message.content == tok.decode([target] * 2)
    def engine_errors() -> float:
        text = httpx.get(served[0] + "/metrics", timeout=30).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "llminfer_request_success_total" and s.labels.get("finished_reason") == "error")

    before = engine_errors()
    for bias in ({"banana": 1}, {str(target): 101}, {str(target): "x"}, {"999999999": 1}):
        _error(http.post("/completions", json={"prompt": "Hi", "max_tokens": 2, "logit_bias": bias}), "logit_bias")
    _error(http.post("/completions", json={"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [10**9]}),
           "stop_token_ids")
    assert engine_errors() == before  # refused by the API layer: no engine request failed


def test_best_of_returns_the_highest_cumulative_logprob(client, http):
    kw = {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "temperature": 1.0, "seed": 11}
    samples = client.completions.create(n=3, logprobs=0, **kw)
    sums = [sum(c.logprobs.token_logprobs) for c in samples.choices]
    best = client.completions.create(best_of=3, **kw)
    (choice,) = best.choices
    assert choice.index == 0 and choice.logprobs is None
    assert choice.text == samples.choices[sums.index(max(sums))].text
    assert best.usage.completion_tokens == samples.usage.completion_tokens  # all best_of samples count
    two = client.completions.create(best_of=3, n=2, logprobs=0, **kw)
    assert [c.index for c in two.choices] == [0, 1]
    assert sorted(sum(c.logprobs.token_logprobs) for c in two.choices) == pytest.approx(sorted(sums)[1:])
    _error(http.post("/completions", json={"prompt": "Hi", "best_of": 2, "n": 3}), "best_of")
    _error(http.post("/completions", json={"prompt": "Hi", "best_of": 3, "stream": True}), "best_of")


def test_refused_and_contradictory_fields(http, served):
    err = _error(http.post("/completions", json={"prompt": "Hi", "suffix": " end"}), "suffix")
    assert "fill-in-the-middle" in err["message"]
    _error(http.post("/completions", json={"prompt": "Hi", "max_tokens": 0}), "max_tokens")
    _error(http.post("/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}),
           "max_tokens")
    err = _error(http.post("/completions", json={"prompt": "Hi", "max_tokens": 2, "min_tokens": 3}), "min_tokens")
    assert "min_tokens" in err["message"] and "max_tokens" in err["message"] and "new_tokens" not in err["message"]
    _error(http.post("/completions", json={"prompt": "Hi", "stop_token_ids": [10**9]}), "stop_token_ids")
    err = _error(http.post("/completions", json={"prompt": "Hi", "logit_bias": {"5": 1, "005": -1}}), "logit_bias")
    assert "token 5" in err["message"]
    _error(http.post("/completions", json={"prompt": "Hi", "truncate_prompt_tokens": 0}), "truncate_prompt_tokens")
    # No field the server refuses is advertised.
    schema = httpx.get(served[0] + "/schema/openapi.json").json()["components"]["schemas"]
    fields = set(schema["CompletionRequest"]["properties"])
    assert "suffix" not in fields and {"prompt_logprobs", "logit_bias", "best_of", "stop_token_ids"} <= fields


def test_chat_message_without_content(http):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user"}], "max_tokens": 2}
    _error(http.post("/chat/completions", json=body), "messages[1].content")
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    ok = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": calls},
                       {"role": "tool", "tool_call_id": "c1", "content": "42"}], "max_tokens": 2}
    assert http.post("/chat/completions", json=ok).status_code == 200


# ---------------------------------------------------------------------------- vLLM's extras
def test_stop_token_ids_text_never_output(client, tok):
    """A stop token id ends the output and its text is in neither the text nor the stream; so is EOS,
    even with skip_special_tokens false. (``min_tokens`` masks the stop id for 2 tokens; the bias then
    makes it the next token.)"""
    kw = {"model": MODEL, "prompt": "Tell me", "max_tokens": 6, "temperature": 0}
    two = client.completions.create(**{**kw, "max_tokens": 2}).choices[0].text
    stop_id = tok.encode(" banana")[0]
    extra = {"stop_token_ids": [stop_id], "min_tokens": 2, "logit_bias": {str(stop_id): 100}}
    r = client.completions.create(extra_body=extra, **kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == two
    assert r.usage.completion_tokens == 3  # the stop token is generated and counted, not shown
    streamed = client.completions.create(stream=True, extra_body=extra, **kw)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == two
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    special = {"logit_bias": {str(eos): 100}, "skip_special_tokens": False}
    r = client.completions.create(extra_body=special, **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)
    streamed = client.completions.create(stream=True, extra_body=special, **kw)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ""


def test_skip_special_tokens_and_spaces(client, tok):
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    kw = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **GREEDY}
    bias = {"logit_bias": {str(im_start): 100}}
    assert client.completions.create(**{**kw, "extra_body": {**GREEDY["extra_body"], **bias}}).choices[0].text == ""
    shown = client.completions.create(**{**kw, "extra_body": {**GREEDY["extra_body"], **bias,
                                                               "skip_special_tokens": False,
                                                               "spaces_between_special_tokens": False}})
    assert shown.choices[0].text == "<|im_start|><|im_start|>"


def test_include_stop_str_min_tokens_truncate(client, http, tok):
    kw = {"model": MODEL, "prompt": "Write", "max_tokens": 8, **GREEDY}
    text = client.completions.create(**kw).choices[0].text
    stop = text[3:6]
    cut = client.completions.create(stop=[stop], **kw).choices[0].text
    kept = client.completions.create(stop=[stop], **{**kw, "extra_body": {**GREEDY["extra_body"],
                                                                          "include_stop_str_in_output": True}})
    assert cut == text[: text.index(stop)] and kept.choices[0].text == cut + stop
    # min_tokens: EOS cannot end the output before it (EOS is pushed to the top with logit_bias).
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    r = client.completions.create(model=MODEL, prompt="Write", max_tokens=6, temperature=0,
                                  extra_body={"min_tokens": 4, "logit_bias": {str(eos): 100}})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    ids = tok.encode("one two three four five six")
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "truncate_prompt_tokens": 3}
    out = http.post("/completions", json=body).json()
    assert out["usage"]["prompt_tokens"] == 3 and out["choices"][0]["text"] == tok.decode(ids[-3:])
    chat = {"messages": [{"role": "user", "content": "Hi " * 50}], "max_tokens": 1, "truncate_prompt_tokens": 7}
    assert http.post("/chat/completions", json=chat).json()["usage"]["prompt_tokens"] == 7


# ---------------------------------------------------------------------------- unknown fields
def test_unknown_fields_accepted_with_a_warning(http):
    with structlog.testing.capture_logs() as logs:
        r = http.post("/completions", json={"prompt": "Hi", "max_tokens": 1, "not_a_field": 1, "zz": 2})
    assert r.status_code == 200, r.text
    assert any(e.get("fields") == ["not_a_field", "zz"] for e in logs if e["log_level"] == "warning")


def test_unknown_fields_rejected_when_asked(qwen2_dir):
    engine = make_engine(qwen2_dir)
    with serve_in_thread(create_app(engine, reject_unknown_fields=True)) as url, \
            httpx.Client(base_url=url + "/v1", timeout=60) as c:
        err = _error(c.post("/completions", json={"prompt": [1, 2], "max_tokens": 1, "not_a_field": 1}), "not_a_field")
        assert err["code"] == "unknown_parameter"
        _error(c.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "bogus": 0}), "bogus")
        _error(c.post("/responses", json={"input": "x", "max_output_tokens": 1, "include": []}), "include")
        ok = {"prompt": [1, 2], "max_tokens": 1, "min_tokens": 1, "suffix": None}
        assert c.post("/completions", json=ok).status_code == 200


# ---------------------------------------------------------------------------- logprob maps keyed by text
class _FakeTokenizer:
    """Token 1 and 2 both render as "a"; 3 and 4 are the two bytes of "é" (each alone is U+FFFD)."""

    texts = {1: "a", 2: "a", 3: "\ufffd", 4: "\ufffd", 5: "b"}
    pieces = {1: "a", 2: "a", 3: "Ã", 4: "©", 5: "b"}  # byte-level alphabet: 0xC3, 0xA9

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.texts[i] for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [1]

    def convert_ids_to_tokens(self, ids):
        return self.pieces[ids] if isinstance(ids, int) else ["\u0120a"]


def test_top_logprobs_keys_never_collide():
    text = TokenText(_FakeTokenizer())
    top = top_map(text, [(1, -0.5), (2, -1.0), (3, -1.5), (4, -2.0), (5, -3.0)])
    assert top == {"a": -0.5, "token_id:2": -1.0, "bytes:\\xc3": -1.5, "bytes:\\xa9": -2.0, "b": -3.0}
    lp = completion_logprobs([TokenLogprob(3, -1.5, ((1, -0.5), (2, -1.0)))], 2, text, 0, first_token=5)
    assert lp.tokens == ["b", "bytes:\\xc3"] and lp.token_logprobs == [None, -1.5]
    assert lp.top_logprobs == [None, {"a": -0.5, "token_id:2": -1.0}]
    assert isinstance(s.json_encoder.encode(lp), bytes)


def test_scheduler_bounds_prompt_logprob_rows_and_skips_the_cache():
    """A request asking for prompt logprobs gets at most ``max_prompt_logprob_rows`` prompt tokens per step
    (shared by all such requests) and no prefix-cache hit; a plain request beside it is not held back."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerLimits(max_batch_size=4, max_num_batched_tokens=64, max_model_len=1000,
                                      max_prompt_logprob_rows=5), kv)
    prompt = tuple(range(1, 13))
    sched.add_request(TokenizedRequest("warm", prompt, SamplingParams(max_new_tokens=1), 0))
    plan, _ = sched.schedule()
    sched.update_from_output(plan, StepOutput(plan.step_id, {"warm": 3}, 0, 0))  # the prompt's blocks are cached
    for rid in ("s1", "s2"):
        sched.add_request(TokenizedRequest(rid, prompt, SamplingParams(max_new_tokens=1, prompt_logprobs=0), 0))
    sched.add_request(TokenizedRequest("plain", prompt, SamplingParams(max_new_tokens=1), 0))
    plan, _ = sched.schedule()
    sizes = {s.request_id: (s.start_position, len(s.token_ids)) for s in plan.sequences}
    assert sizes["s1"] == (0, 5) and "s2" not in sizes  # the 5 rows are spent on s1, from position 0
    assert sizes["plain"] == (8, 4)  # two cached blocks, the last block computed
