"""Programmatic composition: a pipeline assembled from public stages with user stages in it."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import uuid
from pathlib import Path

import anyio
import pytest

from helpers import make_engine, wait_until
from llminfer import EngineError, Pipeline, RequestAbortedError, SamplingParams
from llminfer.models import builtin_model_path
from llminfer.protocols import EngineCore, SendsUpstream, Sink
from llminfer.protocols.messages import Control, GenerationRequest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load_example():
    spec = importlib.util.spec_from_file_location("custom_pipeline", EXAMPLES / "custom_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_pipeline"] = module
    spec.loader.exec_module(module)
    return module


def test_user_stages_filter_and_record(tmp_path):
    ex = _load_example()
    engine = make_engine(builtin_model_path(), max_batch_size=4)
    plain = {p: engine.run(p, max_new_tokens=10).generated_text for p in ("Hello there", "Paged")}
    with pytest.raises(EngineError, match="close"):
        engine.build_pipeline()  # one pipeline at a time on the engine's KV cache
    engine.close()
    out = tmp_path / "deltas.jsonl"
    pipeline = engine.build_pipeline(after_detokenize=[ex.RedactStage(), ex.JsonlRecorder(out)])

    async def go():
        async with pipeline:
            return await ex.generate_all(pipeline, list(plain), 10)

    texts = anyio.run(go)
    for prompt, text in plain.items():
        redacted = "".join("*" if ch in "aeiouAEIOU" else ch for ch in text)
        assert texts[prompt] == redacted
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sum(len(r["token_ids"]) for r in rows) == 20
    assert sum(1 for r in rows if r["finish_reason"]) == 2
    assert engine.cache_stats()["blocks_used"] == 0


def test_pipeline_rejects_bad_assembly():
    engine = make_engine(builtin_model_path())
    stages = engine.default_stages()
    with pytest.raises(ValueError, match="sink"):
        Pipeline([stages["tokenize"], stages["core"], stages["detokenize"]])
    with pytest.raises(ValueError, match="not a stage"):
        Pipeline([object(), stages["sink"]])
    assert isinstance(stages["core"], EngineCore) and isinstance(stages["sink"], Sink)
    assert isinstance(stages["detokenize"], SendsUpstream) and not isinstance(stages["tokenize"], SendsUpstream)


def test_broken_user_stage_fails_requests_instead_of_hanging():
    engine = make_engine(builtin_model_path())

    class Broken:
        name = "broken"

        async def run(self, inbox, outbox):
            async with outbox:
                async for _ in inbox:
                    raise RuntimeError("boom")

    pipeline = engine.build_pipeline(after_detokenize=[Broken()])

    async def go():
        with anyio.fail_after(30):
            async with pipeline:
                stream = await pipeline.submit(_request("x"))
                async with stream:
                    return [delta async for delta in stream]

    deltas = anyio.run(go)
    assert deltas[-1].finished and isinstance(deltas[-1].error, EngineError)
    assert "stage broken failed: RuntimeError: boom" in str(deltas[-1].error)


class Gate:
    """Holds every message in front of the core until ``open`` is set (a request stuck upstream, for as
    long as the test likes); ``holding`` is set once it holds ``count`` messages."""

    name = "gate"

    def __init__(self, count: int) -> None:
        self.count = count
        self.held: list = []
        self.holding = anyio.Event()
        self.open = anyio.Event()

    async def run(self, inbox, outbox):
        async with outbox:
            async for msg in inbox:
                if not self.open.is_set():
                    self.held.append(msg)
                    if len(self.held) >= self.count:
                        self.holding.set()
                        await self.open.wait()
                        for held in self.held:
                            await outbox.send(held)
                    continue
                await outbox.send(msg)


def _request(prompt, max_new_tokens=4):
    return GenerationRequest(uuid.uuid4().hex, prompt, SamplingParams(max_new_tokens=max_new_tokens),
                             time.perf_counter_ns())


def test_abort_sent_before_the_request_reaches_the_core_cancels_it():
    """The abort travels behind its request on the one ordered inbox: however long the request waits
    upstream (here: until the test opens the gate; there is no timeout to outlast), the core sees the
    request first, then its abort, and frees its blocks."""
    engine = make_engine(builtin_model_path())
    stages = engine.default_stages()
    gate = Gate(count=2)
    pipeline = Pipeline([stages["tokenize"], gate, stages["prefix_hash"], stages["core"], stages["detokenize"],
                         stages["sink"]])
    long = _request("a prompt that waits upstream", max_new_tokens=500)

    async def go():
        with anyio.fail_after(60):
            async with pipeline:
                stream = await pipeline.submit(long)
                pipeline.abort(long.request_id)
                await gate.holding.wait()  # both the request and its abort are stuck in front of the core
                assert engine.cache_stats()["queries"] == 0
                gate.open.set()
                async with stream:
                    deltas = [d async for d in stream]
                done = anyio.Event()
                pipeline.send_nowait(Control("drain", done))
                await done.wait()
                after = await pipeline.submit(_request("next"))
                async with after:
                    return deltas, [d async for d in after]

    deltas, after = anyio.run(go)
    assert deltas[-1].finish_reason == "abort" and isinstance(deltas[-1].error, RequestAbortedError)
    assert sum(len(d.token_ids) for d in deltas) < 500  # cut short: the abort was not lost
    assert after[-1].finish_reason == "length"
    stats = engine.cache_stats()
    assert stats["blocks_used"] == 0 and engine.scheduler_stats() == {"running": 0, "waiting": 0}


def test_handle_cancel_while_waiting_upstream_frees_everything():
    """The same through the engine's own API: a stream closed before its request reached the core."""
    engine = make_engine(builtin_model_path())
    with engine:
        chunks = engine.stream("hello", max_new_tokens=300)
        next(chunks)
        chunks.close()
        engine.wait_drained()
        assert engine.cache_stats()["blocks_used"] == 0
        assert engine.run("again", max_new_tokens=3).finish_reason == "length"


def test_stop_string_finish_goes_through_the_core_and_counts_delivered_tokens():
    """A stop-string hit sends FinishRequest upstream and a non-final delta; tokens the core produced
    meanwhile are dropped, and the core's final update becomes a "stop" delta whose stats count only the
    delivered tokens (also when the core ended the request first, with "length")."""
    from transformers import AutoTokenizer

    from llminfer.protocols.messages import EngineStepOutput, FinishRequest, SequenceUpdate, TokenizedRequest
    from llminfer.results import GenerationStats
    from llminfer.stages.detokenize import DetokenizeStage

    tok = AutoTokenizer.from_pretrained(str(builtin_model_path()))
    ids = tok.encode(" hello world again", add_special_tokens=False)
    stage = DetokenizeStage(tok)
    params = SamplingParams(max_new_tokens=10, stop_sequences=("world",))
    stage.add_request(TokenizedRequest("r", (1,), params, 0))  # at submit (Pipeline.submit)
    deltas, finishes = stage.process(EngineStepOutput(0, (SequenceUpdate("r", tuple(ids)),), 0))
    assert finishes == [FinishRequest("r", len(ids))]
    assert not deltas[0].finished and "world" not in deltas[0].text and deltas[0].text.strip() == "hello"
    stats = GenerationStats(10.0, 1.0, 0.0, 1, len(ids) + 2, False, 0)
    late = SequenceUpdate("r", (5, 6), "length", stats=stats)  # the core finished it before FinishRequest arrived
    deltas, finishes = stage.process(EngineStepOutput(1, (late,), 0))
    assert not finishes and len(deltas) == 1
    final = deltas[0]
    assert final.finish_reason == "stop" and final.text == "" and final.token_ids == ()
    assert final.stats.completion_tokens == len(ids) and final.stats.throughput_tokens_per_sec == len(ids) / 0.01
    assert stage.states == {}
    assert stage.process(EngineStepOutput(2, (SequenceUpdate("r", (7,)),), 0)) == ([], [])  # unknown now


def test_stop_strings_wait_for_min_new_tokens():
    """vLLM's min_tokens: a stop string is not looked for until the request has that many tokens; the one
    that completes later still stops it, with the text cut before it."""
    from transformers import AutoTokenizer

    from llminfer.protocols.messages import EngineStepOutput, FinishRequest, SequenceUpdate, TokenizedRequest
    from llminfer.stages.detokenize import DetokenizeStage

    tok = AutoTokenizer.from_pretrained(str(builtin_model_path()))
    ids = tok.encode(" world hello world again", add_special_tokens=False)
    assert tok.decode(ids[:3]) == " world hello world"
    for min_new_tokens, expected_text, at in ((0, "", 1), (3, " world hello", 3)):
        stage = DetokenizeStage(tok)
        params = SamplingParams(max_new_tokens=10, stop_sequences=("world",), min_new_tokens=min_new_tokens)
        stage.add_request(TokenizedRequest("r", (1,), params, 0))
        text = ""
        for step, token in enumerate(ids, start=1):
            deltas, finishes = stage.process(EngineStepOutput(step, (SequenceUpdate("r", (token,)),), 0))
            text += "".join(d.text for d in deltas)
            if finishes:
                assert finishes == [FinishRequest("r", step)] and step == at
                break
        assert text.strip() == expected_text.strip() and "world" not in text[len(expected_text):]


def test_output_state_is_registered_at_submit_and_dropped_at_the_end():
    """The detokenize stage's state for a request exists from submit (vLLM's OutputProcessor.add_request), while
    the request still waits in front of the core, so the core relays no parameters; it is gone once the request
    finished, and for a request that failed before the core (a token id outside the vocabulary)."""
    from llminfer.protocols.messages import EngineStepOutput

    assert "admitted" not in attrs_fields(EngineStepOutput)
    engine = make_engine(builtin_model_path())
    stages = engine.default_stages()
    gate = Gate(count=2)
    detok = stages["detokenize"]
    pipeline = Pipeline([stages["tokenize"], gate, stages["prefix_hash"], stages["core"], detok, stages["sink"]])
    good, bad = _request("held in front of the core"), _request((10**9,))

    async def go():
        with anyio.fail_after(60):
            async with pipeline:
                streams = [await pipeline.submit(r) for r in (good, bad)]
                await gate.holding.wait()
                assert set(detok.states) == {good.request_id, bad.request_id}
                assert engine.scheduler_stats() == {"running": 0, "waiting": 0}  # the core has not seen them
                gate.open.set()
                out = []
                for stream in streams:
                    async with stream:
                        out.append([d async for d in stream])
                return out

    good_deltas, bad_deltas = anyio.run(go)
    assert good_deltas[-1].finish_reason == "length" and "".join(d.text for d in good_deltas)
    assert bad_deltas[-1].finish_reason == "error"
    assert detok.states == {}


def attrs_fields(cls) -> set[str]:
    return {a.name for a in cls.__attrs_attrs__}


def test_output_state_is_dropped_behind_a_core_that_detokenizes_itself(fake_vllm):
    """vLLM's core makes its own deltas: the detokenize stage drops a request's state when its final delta
    passes, finished or cancelled."""
    from llminfer import Backend, EngineConfig, InferenceEngine

    with InferenceEngine(EngineConfig(backend=Backend.VLLM, batch_timeout_ms=0)).load() as engine:
        assert engine.run("hello world", max_new_tokens=3).finish_reason == "length"
        chunks = engine.stream("hello again", max_new_tokens=50)
        next(chunks)
        chunks.close()
        engine.wait_drained()
        detok = next(s for s in engine._pipeline.stages if s.name == "detokenize")
        assert wait_until(lambda: not detok.states, timeout_s=30)
