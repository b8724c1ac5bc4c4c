"""Fault suite for the engine and its Python API (issue 18): bad strings, a failure injected into every
stage, requests that can never fit, and threads racing start, requests and close().

After every fault the engine must still serve a greedy request identical to the one before, hold no KV
block, and have nothing running or waiting; no stage may keep state for a request that has ended.
"""

from __future__ import annotations

import threading

import anyio
import pytest

from helpers import make_engine, wait_until
from llminfer import EngineClosedError, EngineConfig, EngineError, InferenceEngine, InvalidRequestError
from llminfer.errors import CapacityError, LLMInferError
from llminfer.frontend.input import MAX_CHARS_PER_TOKEN
from llminfer.frontend.output import collect_all
from llminfer.models import builtin_model_path
from llminfer.protocols.messages import Control
from llminfer.sampling.sampler import SamplingState
from llminfer.stages import StopStringMatcher, StreamSink
from llminfer.stages import prefix_hash as prefix_hash_module
from llminfer.trace import DEFAULT_MAX_EVENTS, Tracer

PROMPT = "Hello there, paged attention"
MAX_NEW = 8


class FakePanic(BaseException):
    """What a Rust-backed tokenizer raises when it panics (pyo3's PanicException is a BaseException)."""


@pytest.fixture(scope="module")
def engine():
    with make_engine(builtin_model_path(), max_batch_size=8, block_size=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def baseline(engine):
    return engine.run(PROMPT, max_new_tokens=MAX_NEW).token_ids


def _stage(engine, name):
    return next(s for s in engine._pipeline.stages if s.name == name)


def assert_serving(engine, baseline):
    """The engine still serves the same greedy tokens, and nothing is left of the requests before."""
    engine.wait_drained()
    assert engine.is_running
    assert engine.run(PROMPT, max_new_tokens=MAX_NEW).token_ids == baseline
    engine.wait_drained()
    assert engine.cache_stats()["blocks_used"] == 0
    assert engine.scheduler_stats() == {"running": 0, "waiting": 0}
    sched = _stage(engine, "core").scheduler
    assert not sched.requests and not sched.inflight
    assert not _stage(engine, "detokenize").states
    sink = _stage(engine, "sink")
    assert not sink.streams and not sink._seen_first


def run_each(engine, requests):
    """Submit ``requests`` together; per request its result or the error it failed with."""
    return engine._require_portal().call(collect_all, engine._running_pipeline(), list(requests))


# ---------------------------------------------------------------------------- bad strings, no patches
BAD_INPUTS = [  # (prompt, arguments, the param named, words in the message)
    ("\ud800", {}, "prompt", "lone surrogate U+D800 at character 0"),
    ("\udfff trailing", {}, "prompt", "lone surrogate U+DFFF"),
    ("ok \ud83d then", {}, "prompt", "lone surrogate U+D83D at character 3"),  # half a surrogate pair
    ("hi", {"bad_words": ["fine", "\ud800"]}, "bad_words", "lone surrogate"),
    ("hi", {"force_words": ["\udc00"]}, "force_words", "lone surrogate"),
    ([5, -1], {}, "prompt", "token ids must be in"),
    ([10**9], {}, "prompt", "token ids must be in"),
    ("hi", {"stop_token_ids": [10**9], "min_new_tokens": 2}, "stop_token_ids", "outside the vocabulary"),
    ("hi", {"max_new_tokens": 10**6}, "prompt", "context is 2048 tokens"),  # beyond the context
]


def test_bad_strings_fail_their_request_only(engine, baseline):
    for prompt, kwargs, param, words in BAD_INPUTS:
        with pytest.raises(InvalidRequestError) as err:
            engine.run(prompt, **kwargs)
        assert err.value.param == param and words in str(err.value), (prompt, kwargs, str(err.value))
        assert_serving(engine, baseline)
    # Accepted oddities: a NUL, a lone surrogate as a stop string (it can never match).
    assert engine.run("a\x00b", max_new_tokens=2).stats.completion_tokens == 2
    assert engine.run("hi", max_new_tokens=2, stop_sequences=["\ud800"]).finish_reason == "length"
    with pytest.raises(InvalidRequestError) as err:
        engine.chat([{"role": "user", "content": "x\ud800"}], max_new_tokens=2)
    assert err.value.param == "messages"
    assert_serving(engine, baseline)


def test_a_huge_prompt_is_refused_before_the_tokenizer_sees_it(engine, baseline, monkeypatch):
    seen: list[tuple[int, int]] = []
    encode = engine.tokenizer.encode

    def spy(text, *a, **kw):
        seen.append((len(text), threading.get_ident()))
        return encode(text, *a, **kw)

    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    limit = engine.max_model_len * MAX_CHARS_PER_TOKEN
    with pytest.raises(InvalidRequestError) as err:
        engine.run("a" * (limit + 1), max_new_tokens=2)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    assert seen == []
    # A long prompt that fits is tokenized in a worker thread, a short one on the engine's loop.
    engine.run("word " * 1000, max_new_tokens=1)
    engine.run("short", max_new_tokens=1)
    (long_len, long_thread), (short_len, short_thread) = seen
    assert (long_len, short_len) == (5000, 5) and long_thread != short_thread
    # The same for the HTTP layer's own prompts (chat templates): encode_async.
    seen.clear()
    ids = anyio.run(engine.inputs.encode_async, "word " * 1000)
    assert ids == tuple(encode("word " * 1000)) and seen[0][1] != threading.get_ident()
    assert_serving(engine, baseline)


# ---------------------------------------------------------------------------- a failure in every stage
def _raise_if(value, target, exc_type=RuntimeError):
    if value == target:
        raise exc_type("injected fault")


def _inject(name, engine, monkeypatch, bad):
    """Make ``bad`` (and only it) fail in the stage called ``name``; returns the error type expected."""
    if name == "tokenizer panic":
        encode = engine.tokenizer.encode

        def panicking_encode(text, *a, **kw):
            _raise_if(text, "PANIC", FakePanic)
            return encode(text, *a, **kw)
        monkeypatch.setattr(engine.tokenizer, "encode", panicking_encode)
        return InvalidRequestError
    if name == "tokenize":
        inputs = _stage(engine, "tokenize").inputs
        process = inputs.process

        def failing_process(msg):
            _raise_if(msg.request_id, bad.request_id, FakePanic)
            return process(msg)
        monkeypatch.setattr(inputs, "process", failing_process)
    elif name == "prefix hash":
        hash_blocks = prefix_hash_module.hash_full_blocks

        def failing_hash(ids, *a):
            _raise_if(tuple(ids), tuple(bad.prompt))
            return hash_blocks(ids, *a)
        monkeypatch.setattr(prefix_hash_module, "hash_full_blocks", failing_hash)
    elif name == "admission":
        sched = _stage(engine, "core").scheduler
        add = sched.add_request

        def failing_add(msg):
            _raise_if(msg.request_id, bad.request_id)
            return add(msg)
        monkeypatch.setattr(sched, "add_request", failing_add)
    elif name == "sampling":
        process_row = SamplingState.process

        def failing_row(self, row):
            _raise_if(self.params.repetition_penalty, bad.params.repetition_penalty)
            return process_row(self, row)
        monkeypatch.setattr(SamplingState, "process", failing_row)
    elif name == "detokenize":
        feed = StopStringMatcher.feed

        def failing_feed(self, text, final, match=True):
            _raise_if(self.stops, bad.params.stop_sequences)
            return feed(self, text, final, match)
        monkeypatch.setattr(StopStringMatcher, "feed", failing_feed)
    elif name == "sink":
        deliver = StreamSink.deliver

        def failing_deliver(self, delta):
            if delta.token_ids:
                _raise_if(delta.request_id, bad.request_id)
            return deliver(self, delta)
        monkeypatch.setattr(StreamSink, "deliver", failing_deliver)
    return EngineError


STAGE_FAULTS = ["tokenizer panic", "tokenize", "prefix hash", "admission", "sampling", "detokenize", "sink"]
BAD_REQUESTS = {"tokenizer panic": ("PANIC", {}), "prefix hash": ([9] * 12, {}),
                "sampling": (PROMPT, {"repetition_penalty": 1.01}), "detokenize": (PROMPT, {"stop_sequences": ["zzz"]})}


@pytest.mark.parametrize("name", STAGE_FAULTS)
def test_a_failure_in_one_stage_fails_that_request_only(engine, baseline, monkeypatch, name):
    prompt, kwargs = BAD_REQUESTS.get(name, (PROMPT, {}))
    bad = engine.make_request(prompt, max_new_tokens=MAX_NEW, **kwargs)
    expected = _inject(name, engine, monkeypatch, bad)
    good = [engine.make_request(PROMPT, max_new_tokens=MAX_NEW) for _ in range(2)]
    results = run_each(engine, [good[0], bad, good[1]])  # submitted together: one batch
    assert isinstance(results[1], expected), results[1]
    assert "injected fault" in str(results[1])
    assert [r.token_ids for r in (results[0], results[2])] == [baseline, baseline]
    monkeypatch.undo()
    assert_serving(engine, baseline)


# ---------------------------------------------------------------------------- whole-step failures
def _once(fn, exc=RuntimeError("injected step fault")):
    calls = []

    def wrapper(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise exc
        return fn(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("where", ["forward", "execute", "schedule", "update_from_output", "control"])
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(engine, baseline, monkeypatch, where):
    core = _stage(engine, "core")
    if where == "control":  # an unknown control message (a user stage's typo) is logged and dropped
        async def bogus():
            done = anyio.Event()
            assert engine._pipeline.send_nowait(Control("bogus", done))
            with anyio.fail_after(60):  # a bound: an unhandled action would leave it unset for ever
                await done.wait()

        engine._require_portal().call(bogus)
        assert_serving(engine, baseline)
        return
    owner = {"forward": core.backend, "execute": core.backend}.get(where, core.scheduler)
    monkeypatch.setattr(owner, where, _once(getattr(owner, where)))
    results = run_each(engine, [engine.make_request(PROMPT, max_new_tokens=MAX_NEW) for _ in range(3)])
    failed = [r for r in results if isinstance(r, LLMInferError)]
    assert failed and all(isinstance(r, EngineError) and "injected step fault" in str(r) for r in failed)
    assert all(r.token_ids == baseline for r in results if r not in failed)
    monkeypatch.undo()
    assert_serving(engine, baseline)


# ---------------------------------------------------------------------------- requests that never fit
def test_requests_that_can_never_fit_are_refused_or_capped_at_admission():
    with make_engine(builtin_model_path(), block_size=4, num_blocks=8) as eng:  # 32 tokens of KV in all
        before = eng.run([7] * 10, max_new_tokens=4).token_ids
        with pytest.raises(CapacityError) as err:  # 10 + 30 - 1 tokens of KV can never be held
            eng.run([7] * 10, max_new_tokens=30)
        assert err.value.param == "max_new_tokens" and "at most 23" in str(err.value)
        full = eng.run([7] * 10, max_new_tokens=23, ignore_eos=True)  # exactly the pool
        assert full.finish_reason == "length" and full.stats.completion_tokens == 23
        # No max_new_tokens: capped at what the pool holds, a "length" finish and not an error.
        open_ended = eng.run([7] * 10, max_new_tokens=None, ignore_eos=True)
        assert open_ended.finish_reason == "length" and open_ended.stats.completion_tokens == 23
        eng.wait_drained()
        assert eng.cache_stats()["blocks_used"] == 0
        assert eng.scheduler_stats() == {"running": 0, "waiting": 0}
        assert eng.run([7] * 10, max_new_tokens=4).token_ids == before


# ---------------------------------------------------------------------------- the trace ring
def test_trace_ring_is_bounded_and_counts_what_it_drops(engine):
    assert engine.tracer.max_events == DEFAULT_MAX_EVENTS
    tracer = Tracer(max_events=4)
    for i in range(10):
        tracer.record(str(i), "s", "e")
    assert [e.request_id for e in tracer.snapshot()] == ["6", "7", "8", "9"] and tracer.dropped == 6
    tracer.ensure_capacity(8)
    tracer.record("10", "s", "e")
    assert tracer.max_events == 8 and len(tracer.snapshot()) == 5
    tracer.clear()
    assert tracer.snapshot() == [] and tracer.dropped == 0


def test_stop_string_and_abort_leave_no_state_in_any_stage(engine, baseline):
    text = engine.run(PROMPT, max_new_tokens=MAX_NEW).generated_text
    stop = text[2:4]
    r = engine.run(PROMPT, max_new_tokens=MAX_NEW, stop_sequences=[stop])
    assert r.finish_reason == "stop"
    chunks = engine.stream(PROMPT, max_new_tokens=200, ignore_eos=True)
    next(chunks)
    chunks.close()
    assert_serving(engine, baseline)


# ---------------------------------------------------------------------------- the facade and threads
def test_close_is_final_idempotent_and_clear():
    eng = make_engine(builtin_model_path())
    eng.run("hi", max_new_tokens=2)
    eng.close()
    eng.close()
    assert eng.closed and not eng.is_running
    for call in (lambda: eng.run("hi", max_new_tokens=2), lambda: list(eng.stream("hi", max_new_tokens=2)),
                 eng.start, lambda: eng.run_batch(["a", "b"], max_new_tokens=2)):
        with pytest.raises(EngineClosedError, match="close"):
            call()
    eng.wait_drained()  # nothing runs: returns at once
    eng.close()
    never_loaded = InferenceEngine(EngineConfig())
    never_loaded.close()
    with pytest.raises(EngineClosedError, match="close"):
        never_loaded.load()  # a closed engine loads no weights


@pytest.mark.slow
def test_stress_threads_run_stream_cancel_while_start_and_close_race():
    """16 threads x 4 operations (run, stream to the end, stream cancelled early, run_batch) on an engine
    loaded but not started; one thread starts it, another closes it mid-way. Every operation either
    succeeds or raises EngineClosedError; no thread is left behind; the KV pool is free."""
    with make_engine(builtin_model_path()) as ref:
        reference = ref.run("stress 0", max_new_tokens=3).token_ids
    eng = make_engine(builtin_model_path(), max_batch_size=8)
    before = set(threading.enumerate())
    started = threading.Barrier(16)
    outcomes: list[str] = []
    unexpected: list[BaseException] = []
    lock = threading.Lock()

    def op(i: int, k: int) -> str:
        prompt = f"stress {(i + k) % 3}"
        if (i + k) % 4 == 0:
            r = eng.run(prompt, max_new_tokens=3)
            assert prompt != "stress 0" or r.token_ids == reference
        elif (i + k) % 4 == 1:
            assert sum(len(c.token_ids) for c in eng.stream(prompt, max_new_tokens=3)) == 3
        elif (i + k) % 4 == 2:
            chunks = eng.stream(prompt, max_new_tokens=50, ignore_eos=True)
            next(chunks)
            chunks.close()
        else:
            assert len(eng.run_batch_continuous([prompt, prompt], max_new_tokens=2)) == 2
        return "ok"

    def worker(i: int) -> None:
        started.wait(60)
        for k in range(4):
            if i == 0 and k == 0:
                eng.start()
            if i == 1 and k == 2:
                eng.close()
            try:
                result = op(i, k)
            except EngineClosedError:
                result = "closed"
            except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
                with lock:
                    unexpected.append(exc)
                result = "unexpected"
            with lock:
                outcomes.append(result)

    threads = [threading.Thread(target=worker, args=(i,), name=f"stress-{i}") for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(not t.is_alive() for t in threads)
    assert not unexpected, unexpected
    assert len(outcomes) == 64 and "ok" in outcomes and "closed" in outcomes
    # Nobody restarted it after the racing close(), and its background loop has gone.
    assert eng.closed and not eng.is_running
    assert wait_until(lambda: set(threading.enumerate()) <= before, 30), set(threading.enumerate()) - before
    eng.close()  # again: a no-op
    assert eng.cache_stats()["blocks_used"] == 0
    assert eng.scheduler_stats() == {"running": 0, "waiting": 0}
