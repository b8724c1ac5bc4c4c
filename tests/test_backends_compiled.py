"""The compiled backend (torch.compile): greedy outputs equal the eager backend's, no recompilation after
warm-up across batch sizes, and a failing compiled step falls back to eager without losing a request.

Most tests compile with dynamo's ``aot_eager`` backend (the same dynamo graph capture, shape bucketing and
guards as inductor, without inductor's C++ code generation, which takes tens of seconds per graph on two
cold cores); ``test_inductor_matches_eager`` runs the real inductor path.
"""

from __future__ import annotations

import pytest
import structlog

from helpers import make_engine, random_prompts
from llminfer import Backend, ConfigError, EngineConfig, EngineError
from llminfer.backends import compiled_attention
from llminfer.backends.compiled import COMPILE_BACKEND_ENV, CompiledBackend, bucket_for, token_buckets
from llminfer.cli.serve import warm_up
from llminfer.logging import configure_logging, reset_logging

VOCAB = 151_000
LENGTHS = [1, 3, 7, 16, 33, 50, 5, 12]
NEW = 10


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")


@pytest.fixture
def compile_lines():
    """The status lines of compiles that a request waited for, logged during the test (at debug level)."""
    configure_logging("debug")
    try:
        with structlog.testing.capture_logs() as logs:
            yield lambda: [e["event"] for e in logs if "(first request of this size)" in e["event"]]
    finally:
        reset_logging()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, VOCAB, seed=11)


@pytest.fixture(scope="module")
def eager_outputs(model_dirs, prompts):
    out = {}
    for arch, d in model_dirs.items():
        with make_engine(d, max_batch_size=4, max_num_batched_tokens=64) as engine:
            out[arch] = [r.token_ids for r in engine.run_batch_continuous(prompts, max_new_tokens=NEW,
                                                                          min_new_tokens=NEW)]
    return out


def test_buckets():
    assert token_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert token_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert token_buckets(1) == (1,)
    assert bucket_for(5, token_buckets(64)) == 8
    assert bucket_for(64, token_buckets(64)) == 64
    assert bucket_for(65, token_buckets(64)) is None
    with pytest.raises(ValueError):
        token_buckets(0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_compiled_matches_eager(aot_eager, model_dirs, prompts, eager_outputs, arch, compile_lines):
    """Chunked prefill (64-token steps), mixed prefill + decode steps, 4 at a time: same greedy tokens."""
    with make_engine(model_dirs[arch], max_batch_size=4, max_num_batched_tokens=64,
                     backend=Backend.COMPILED) as engine:
        results = engine.run_batch_continuous(prompts, max_new_tokens=NEW, min_new_tokens=NEW)
        stats = engine.backend.stats()
        info = engine.info()
    assert [r.token_ids for r in results] == eager_outputs[arch]
    assert stats["compiled_steps"] > 0 and stats["eager_steps"] == 0 and not stats["fell_back_to_eager"]
    assert 1 <= stats["num_compiles"] <= len(token_buckets(64))
    assert info["backend"] == "compiled" and info["compile"]["num_compiles"] == stats["num_compiles"]
    assert len(compile_lines()) == stats["num_compiles"]  # one status line per graph, before it compiles


def test_no_recompile_after_warmup(aot_eager, qwen2_dir, compile_lines, capsys):
    """After warm-up of every bucket, batches of 1..8 requests with prompts of varied lengths (prefill,
    decode and mixed steps of every size up to the budget) compile nothing more."""
    with make_engine(qwen2_dir, max_batch_size=8, max_num_batched_tokens=32, backend=Backend.COMPILED) as engine:
        backend = engine.backend
        assert isinstance(backend, CompiledBackend)
        assert warm_up(engine) == len(backend.buckets) == len(token_buckets(32))  # what `serve` runs
        err = capsys.readouterr().err  # without a terminal (no status line): said before and after
        assert "\ncompiling the model step for every batch shape" in "\n" + err and "graph(s) in" in err
        warm = backend.num_compiles
        for batch in (1, 3, 8, 2, 5):
            ps = random_prompts([(7 * i + batch) % 20 + 1 for i in range(batch)], VOCAB, seed=batch)
            engine.run_batch_continuous(ps, max_new_tokens=6, min_new_tokens=6)
        assert backend.num_compiles == warm
        assert backend.num_compiled_steps > 10 and backend.num_eager_steps == 0
        assert compile_lines() == []  # the warm-up compiled every shape: no request waits for a compile


def test_weight_only_models_keep_inductors_python_wrapper(qwen2_dir, monkeypatch):
    """The C++ wrapper of a graph calling llminfer's weight-only ops took minutes to compile (the built-in
    SmolLM2 under int4-wo: 277 s to its first token, 8.9 s with the Python wrapper): such models keep it off;
    dense models keep it on."""
    from llminfer.backends import compile_config
    from llminfer.config import QuantConfig

    monkeypatch.delenv(compile_config.CPP_WRAPPER_ENV, raising=False)
    for quant, wrapper in (("none", True), ("int8-wo", False)):
        with make_engine(qwen2_dir, backend=Backend.COMPILED, quant=QuantConfig(mode=quant)) as engine:
            assert engine.backend._counter.options.get("cpp_wrapper", False) is wrapper, quant


def test_prompt_logprobs_on_the_compiled_backend(aot_eager, qwen2_dir):
    """A step with prompt-logprob rows runs eagerly on the compiled backend (its row count fits no bucket):
    its attention takes the metadata it is given (it once failed with "called outside an llminfer step"),
    and the prompt logprobs equal the eager backend's."""
    kw = dict(max_new_tokens=3, ignore_eos=True, prompt_logprobs=1)
    with make_engine(qwen2_dir, max_batch_size=2) as engine:
        want = engine.run("The quick brown fox", **kw)
    with make_engine(qwen2_dir, max_batch_size=2, backend=Backend.COMPILED, compile_fallback_to_eager=False) as engine:
        got = engine.run("The quick brown fox", **kw)
        assert engine.backend.num_eager_steps > 0 and engine.backend.compiled_ok
    assert got.token_ids == want.token_ids and got.prompt_logprobs and len(got.prompt_logprobs) == len(want.prompt_logprobs)
    for a, b in zip(got.prompt_logprobs, want.prompt_logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def _boom_backend(gm, example_inputs):
    raise RuntimeError("forced compile failure")


def _boom_attention(*args, **kwargs):
    raise RuntimeError("forced runtime failure in the compiled step")


@pytest.mark.parametrize("failure", ["compile", "runtime"])
def test_failure_falls_back_to_eager(aot_eager, monkeypatch, model_dirs, prompts, eager_outputs, failure):
    engine = make_engine(model_dirs["qwen2"], max_batch_size=4, max_num_batched_tokens=64, backend=Backend.COMPILED)
    with engine, structlog.testing.capture_logs() as logs:
        backend = engine.backend
        if failure == "compile":
            backend._counter.name = _boom_backend
        else:
            monkeypatch.setattr(compiled_attention, "paged_attention_forward", _boom_attention)
        results = engine.run_batch_continuous(prompts, max_new_tokens=NEW, min_new_tokens=NEW)
    assert [r.token_ids for r in results] == eager_outputs["qwen2"]
    assert all(r.finish_reason == "length" for r in results)
    stats = backend.stats()
    assert stats["fell_back_to_eager"] and "forced" in stats["fallback_error"]
    assert stats["compiled_steps"] == 0 and stats["eager_steps"] > 0
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and "eager" in warnings[0]["event"]


def test_failure_without_fallback_fails_the_requests(aot_eager, qwen2_dir):
    engine = make_engine(qwen2_dir, backend=Backend.COMPILED, compile_fallback_to_eager=False)
    with engine:
        engine.backend._counter.name = _boom_backend
        with pytest.raises(EngineError, match="forced compile failure"):
            engine.run([1, 2, 3], max_new_tokens=3)
        assert engine.backend.compiled_ok  # no silent switch


@pytest.mark.slow
def test_inductor_matches_eager(monkeypatch, model_dirs, prompts, eager_outputs):
    """The real path: inductor with its C++ kernels (each bucket compiles once; ~20-60 s on two cores)."""
    monkeypatch.delenv(COMPILE_BACKEND_ENV, raising=False)
    with make_engine(model_dirs["llama"], max_batch_size=4, max_num_batched_tokens=64,
                     backend=Backend.COMPILED) as engine:
        results = engine.run_batch_continuous(prompts, max_new_tokens=NEW, min_new_tokens=NEW)
        stats = engine.backend.stats()
    assert stats["compile_backend"] == "inductor" and stats["compiled_steps"] > 0 and not stats["fell_back_to_eager"]
    assert [r.token_ids for r in results] == eager_outputs["llama"]


@pytest.mark.parametrize("backend", [Backend.EAGER, Backend.COMPILED])
@pytest.mark.parametrize("field", ["tp_size", "pp_size"])
def test_parallelism_needs_vllm(backend, field):
    with pytest.raises(ConfigError, match="vLLM backend"):
        EngineConfig(backend=backend, **{field: 2}).validate()


def test_speculative_refused_on_compiled(qwen2_dir):
    with pytest.raises(ConfigError, match="eager backend"):
        make_engine(qwen2_dir, backend=Backend.COMPILED, assistant_model_name=str(qwen2_dir))


def test_warmup_runs_on_the_model_thread_and_any_thread_raises_the_recompile_limit(aot_eager, qwen2_dir):
    """torch's dynamo config is per thread: the recompile limit raised when the backend was built (on the
    model thread) reads as the default (8) in every other thread, where a warm-up of more than 8 shapes
    then gave up compiling. Every thread that compiles raises it itself, and ``engine.warmup()`` (what
    ``serve`` runs) compiles on the model thread, where the steps run."""
    import threading

    import torch

    with make_engine(qwen2_dir, max_batch_size=2, max_num_batched_tokens=16, backend=Backend.COMPILED) as engine:
        seen: dict[str, int] = {}

        def in_a_fresh_thread():
            engine.backend.warmup(max_tokens=1)
            seen["limit"] = torch._dynamo.config.recompile_limit

        thread = threading.Thread(target=in_a_fresh_thread)
        thread.start()
        thread.join()
        assert seen["limit"] >= 64 and engine.backend.compiled_ok
        warm, threads = engine.backend.warmup, []
        engine.backend.warmup = lambda *args: threads.append(threading.get_ident()) or warm(*args)
        try:
            assert engine.warmup() >= 0
        finally:
            del engine.backend.warmup
        assert threads == [engine.model_thread.call(threading.get_ident)] and engine.backend.compiled_ok
