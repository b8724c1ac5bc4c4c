"""The Python API on the built-in model: streaming, stop strings, cancellation, errors, KV accounting."""

from __future__ import annotations

import threading

import anyio
import pytest

from helpers import make_engine
from llminfer import (
    CapacityError,
    ConfigError,
    EngineConfig,
    EngineError,
    InferenceEngine,
    InvalidRequestError,
    ModelLoadError,
)
from llminfer.models import builtin_model_path


@pytest.fixture(scope="module")
def engine():
    with make_engine(builtin_model_path(), max_batch_size=8, block_size=4) as eng:
        yield eng


def test_stream_joined_equals_run(engine):
    prompt = "日本語のテキストと絵文字 🎉🚀 を混ぜる"
    result = engine.run(prompt, max_new_tokens=40)
    chunks = list(engine.stream(prompt, max_new_tokens=40))
    joined = "".join(c.token for c in chunks)
    assert joined == result.generated_text
    assert [t for c in chunks for t in c.token_ids] == list(result.token_ids)
    assert chunks[-1].is_final and chunks[-1].finish_reason == result.finish_reason
    # Streaming adds no replacement character beyond what the full decode itself holds.
    full = engine.tokenizer.decode(list(result.token_ids), skip_special_tokens=True)
    assert joined == full
    for c in chunks[:-1]:
        assert not c.token.endswith("\ufffd")


def test_stop_string_across_token_boundary(engine):
    prompt = "Hello, my name is"
    base = engine.run(prompt, max_new_tokens=24, ignore_eos=True)
    pieces = [engine.tokenizer.decode([t]) for t in base.token_ids]
    # A stop string made of the end of token 3 and the start of token 4: it spans a boundary.
    i = next(k for k in range(2, len(pieces) - 1) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    expected = base.generated_text[: base.generated_text.find(stop)]
    result = engine.run(prompt, max_new_tokens=24, ignore_eos=True, stop_sequences=[stop])
    assert result.generated_text == expected
    assert result.finish_reason == "stop"
    streamed = "".join(c.token for c in engine.stream(prompt, max_new_tokens=24, ignore_eos=True,
                                                      stop_sequences=["zzzz-never", stop]))
    assert streamed == expected
    assert stop not in streamed
    engine.wait_drained()
    assert engine.cache_stats()["blocks_used"] == 0


def test_earliest_stop_string_wins(engine):
    base = engine.run("Once upon a time", max_new_tokens=20, ignore_eos=True).generated_text
    first, later = base[3:6], base[10:14]
    result = engine.run("Once upon a time", max_new_tokens=20, ignore_eos=True, stop_sequences=[later, first])
    assert result.generated_text == base[: base.find(first)]


def test_cancelled_stream_frees_blocks(engine):
    stream = engine.stream("Tell me a long story", max_new_tokens=500, ignore_eos=True)
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    engine.wait_drained()
    assert engine.cache_stats()["blocks_used"] == 0
    # The engine keeps serving afterwards.
    assert engine.run("again", max_new_tokens=3).stats.completion_tokens == 3


def test_all_blocks_free_after_batch(engine):
    prompts = [f"prompt number {i} " * (i + 1) for i in range(12)]
    results = engine.run_batch_continuous(prompts, max_new_tokens=8)
    assert len(results) == 12
    assert all(r.finish_reason in ("length", "stop") for r in results)
    stats = engine.cache_stats()
    assert stats["blocks_used"] == 0 and stats["blocks_free"] == stats["blocks_total"]


def test_stats_are_consistent(engine):
    r = engine.run("Measure me", max_new_tokens=10, ignore_eos=True)
    s = r.stats
    assert s.completion_tokens == len(r.token_ids) == 10
    assert 0 < s.ttft_ms <= s.total_latency_ms
    assert s.prompt_tokens == len(engine.tokenizer.encode("Measure me"))


def test_seeded_sampling_is_reproducible(engine):
    a = engine.run("Sample", max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=123)
    b = engine.run("Sample", max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=123)
    c = engine.run("Sample", max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=124)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_seed_independent_of_batch(engine):
    alone = engine.run("Batch me", max_new_tokens=10, temperature=1.0, seed=5)
    batch = engine.run_batch_continuous(["other prompt", "Batch me", "third one here"], max_new_tokens=10,
                                        temperature=1.0, seed=5)
    assert batch[1].token_ids == alone.token_ids


@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        ("", {}, "empty"),
        ("x", {"max_new_tokens": 0}, "max_new_tokens"),
        ("x", {"max_new_tokens": -3}, "max_new_tokens"),
        ("x", {"temperature": -1.0}, "temperature"),
        ("x", {"top_p": 0.0}, "top_p"),
        ("x", {"top_k": -1}, "top_k"),
        ("x", {"no_such_knob": 1}, "unknown sampling argument"),
        ([], {}, "empty"),
    ],
)
def test_bad_input_raises_clear_error(engine, prompt, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.run(prompt, **kwargs)


def test_prompt_longer_than_context(engine):
    with pytest.raises(InvalidRequestError, match="context"):
        engine.run([5] * engine.max_model_len)


def test_request_that_can_never_fit_fails_at_once(qwen2_dir):
    with make_engine(qwen2_dir, block_size=4, num_blocks=8) as eng:  # 32 tokens of KV in all
        with pytest.raises(CapacityError):
            eng.run([7] * 40, max_new_tokens=4)
        # Nothing stalls behind it.
        assert eng.run([7] * 10, max_new_tokens=4).stats.completion_tokens == 4


def test_missing_model_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError):
        InferenceEngine(EngineConfig(model_name=str(tmp_path / "nope"))).load()


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="max_batch_size"):
        EngineConfig(max_batch_size=0)
    with pytest.raises(ConfigError, match="tp_size"):
        EngineConfig(tp_size=2).validate()
    cfg = EngineConfig()
    with pytest.raises(ConfigError, match="page_size_tokens"):
        cfg.cache.page_size_tokens = 0
    # an infinite batch timeout held every request back forever; NaN slipped past the ">= 0" check
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="batch_timeout_ms must be a finite number"):
            EngineConfig(batch_timeout_ms=bad)
        with pytest.raises(ConfigError, match="grammar_compile_timeout_s must be a finite number"):
            EngineConfig(grammar_compile_timeout_s=bad)


def test_async_generate_inside_running_loop():
    async def main():
        engine = make_engine(builtin_model_path(), max_batch_size=4)
        async with engine.running():
            chunks = [c async for c in engine.generate("async hello", max_new_tokens=6, ignore_eos=True)]
            assert chunks[-1].is_final
            assert sum(len(c.token_ids) for c in chunks) == 6
            # An async consumer that stops early cancels the request.
            agen = engine.generate("stop early", max_new_tokens=200, ignore_eos=True)
            async for _ in agen:
                break
            await agen.aclose()
            await engine.drained()
            assert engine.cache_stats()["blocks_used"] == 0

    anyio.run(main)


def test_generate_cancelled_inside_submit_is_aborted():
    """A cancellation that lands while the request is being submitted still aborts it (found by attack:
    a pre-cancelled scope left the request running with its blocks held)."""
    async def main():
        engine = make_engine(builtin_model_path(), max_batch_size=4)
        async with engine.running():
            for _ in range(3):
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    async for _ in engine.generate("y", max_new_tokens=None, ignore_eos=True):
                        pass
            with anyio.fail_after(60):  # a bound, not a timing: without the fix this never returns
                await engine.drained()
            assert engine.cache_stats()["blocks_used"] == 0
            assert engine.scheduler_stats() == {"running": 0, "waiting": 0}
            with pytest.raises(EngineError, match="await engine.drained"):
                engine.wait_drained()  # would deadlock the loop it runs on

    anyio.run(main)


def test_threads_starting_the_engine_at_once():
    engine = make_engine(builtin_model_path(), max_batch_size=8)
    out: list = []

    def worker():
        try:
            out.append(engine.run("hello", max_new_tokens=3).finish_reason)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            out.append(repr(exc))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    engine.close()
    engine.close()
    assert out == ["length"] * 6


def test_out_of_range_seed_is_a_bad_value(engine):
    with pytest.raises(InvalidRequestError) as err:
        engine.run("hi", max_new_tokens=2, temperature=1.0, seed=2**70)
    assert err.value.param == "seed"
