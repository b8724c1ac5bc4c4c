"""The original project description's snippets, run as written (the built-in model in place of hub ids):
its imports, config fields, ``KVCacheManager.hash_prefix``, ``BackendComparison.print_table / plot``,
``run_batch_continuous``, the adapter calls, and its stream consumer loop, which must print exactly
``run()``'s text on every streaming path (Python, async, CLI, HTTP SSE)."""

from __future__ import annotations

import contextlib
import hashlib
import io

import anyio
import openai
import pytest

from helpers import make_engine
from llminfer.models import builtin_model_path

NEW = 20


@pytest.fixture(scope="module")
def engine():
    """One engine for the module (loading is the slow part): the sync methods start its background loop;
    the async and HTTP tests stop that first and run it in their own loop (it restarts on the next call)."""
    eng = make_engine(builtin_model_path(), max_batch_size=8, block_size=4)
    yield eng
    eng.close()


def description_loop(chunks) -> tuple[str, object]:
    """The description's consumer loop, verbatim but for printing into a buffer."""
    out = io.StringIO()
    final = None
    for chunk in chunks:
        if not chunk.is_final:
            print(chunk.token, end="", flush=True, file=out)
        else:
            final = chunk  # the description prints chunk.stats and chunk.finish_reason here
    return out.getvalue(), final


# ---------------------------------------------------------------------------- imports and config
def test_imports_as_written():
    from llminfer import Benchmarker, EngineConfig, InferenceEngine
    from llminfer.benchmark import BackendComparison
    from llminfer.benchmark import Benchmarker as BenchmarkerFromPackage
    from llminfer.config import Backend, QuantConfig, QuantMode
    from llminfer.kv.manager import KVCacheManager as Manager
    from llminfer.kv_cache import KVCacheManager

    assert Benchmarker is BenchmarkerFromPackage and KVCacheManager is Manager
    assert callable(InferenceEngine) and callable(EngineConfig) and callable(BackendComparison)
    cfg = EngineConfig(backend=Backend.EAGER, quant=QuantConfig(mode=QuantMode.INT8))
    assert cfg.quant.mode is QuantMode.INT8 and cfg.backend is Backend.EAGER
    with pytest.raises(AttributeError, match="no attribute 'Benchmarkr'"):
        import llminfer

        llminfer.Benchmarkr  # noqa: B018


def test_cache_fields_shape_the_kv_cache(engine):
    from llminfer import EngineConfig

    cfg = EngineConfig()
    assert cfg.cache.enable_paged_kv is True and cfg.cache.page_size_tokens == 16
    cfg.cache.enable_paged_kv = True
    cfg.cache.page_size_tokens = 8
    assert cfg.cache.page_size_tokens == 8
    # The module engine was built with page_size_tokens=4: its blocks hold 4 tokens.
    assert engine.cfg.cache.page_size_tokens == engine.kv_manager.block_size == 4


# ---------------------------------------------------------------------------- hash_prefix
def test_hash_prefix_of_text_is_a_sha256_key():
    from llminfer.kv_cache import KVCacheManager

    key = KVCacheManager.hash_prefix("You are a helpful assistant.")
    assert key == hashlib.sha256(b"You are a helpful assistant.").hexdigest()
    assert key == KVCacheManager.hash_prefix("You are a helpful assistant.")
    assert key != KVCacheManager.hash_prefix("You are a helpful assistant!")
    with pytest.raises(ValueError, match="token ids"):
        KVCacheManager.hash_prefix("text", block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager.hash_prefix([1, 2, 3, 4])
    with pytest.raises(ValueError, match="do not fill one block"):
        KVCacheManager.hash_prefix([1, 2, 3], block_size=4)


def test_hash_prefix_of_token_ids_is_the_prefix_caches_own_key(engine):
    from llminfer.kv_cache import KVCacheManager

    system = "You are a concise assistant. Answer in one line."
    prompt = system + " What is a KV cache?"
    ids = engine.tokenizer.encode(prompt)
    prefix = engine.tokenizer.encode(system)
    assert ids[: len(prefix)] == prefix  # the system prompt tokenizes the same inside the prompt
    bs = engine.cfg.cache.page_size_tokens
    engine.reset_prefix_cache()
    engine.run(prompt, max_new_tokens=2)
    engine.run(prompt, max_new_tokens=2, cache_salt="tenant-b")
    cached = {b.block_hash.hex() for b in engine.kv_manager.pool.blocks if b.block_hash is not None}
    key = KVCacheManager.hash_prefix(prefix, block_size=bs)
    assert key in cached
    assert KVCacheManager.hash_prefix(prefix, block_size=bs, cache_salt="tenant-b") in cached
    assert KVCacheManager.hash_prefix(prefix, block_size=bs, cache_salt="tenant-c") not in cached
    # Only full blocks count: a partial block on top does not change the key.
    whole = len(prefix) // bs * bs
    assert KVCacheManager.hash_prefix(prefix[:whole], block_size=bs) == key
    # A prompt that shares the prefix hits at least those blocks.
    again = engine.run(system + " Another question?", max_new_tokens=2)
    assert again.stats.cached_tokens >= whole


# ---------------------------------------------------------------------------- benchmark and comparison
def test_benchmarker_and_backend_comparison_table_and_plot(engine, tmp_path, capsys):
    from llminfer import Benchmarker
    from llminfer.benchmark import BackendComparison, ComparisonResult

    result = Benchmarker(engine, prompt_len=8).run(batch_sizes=[1, 2], num_runs=1, max_new_tokens=2, warmup=0)
    results = ComparisonResult({"eager": result}, {"vllm": "vLLM is not installed"}, {})
    text = BackendComparison.print_table(results)
    assert capsys.readouterr().out == text + "\n"
    assert "eager" in text and "vllm: skipped — vLLM is not installed" in text
    assert text == results.print_table()
    capsys.readouterr()
    # A plain {backend: BenchmarkResult} mapping works too.
    assert "eager" in BackendComparison.print_table({"eager": result})
    path = BackendComparison.plot(results, tmp_path / "compare.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert BackendComparison.plot({"eager": result}, tmp_path / "mapping.png").exists()
    with pytest.raises(TypeError, match="ComparisonResult"):
        BackendComparison.print_table([result])


# ---------------------------------------------------------------------------- batches and adapters
def test_run_batch_continuous_equals_single_runs(engine):
    prompts = ["The capital of France is", "Once upon a time", "def fib(n):"]
    batch = engine.run_batch_continuous(prompts, max_new_tokens=6)
    assert [r.generated_text for r in batch] == [engine.run(p, max_new_tokens=6).generated_text for p in prompts]


def test_adapter_calls(engine, tmp_path):
    peft = pytest.importorskip("peft", reason="PEFT is not installed (pip install 'llminfer[peft]')")
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(builtin_model_path()), dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(base, lora).save_pretrained(str(tmp_path / "medical"))
    prompt = "The patient reports"
    plain = engine.run(prompt, max_new_tokens=8).generated_text
    try:
        assert engine.load_adapter(str(tmp_path / "medical"), adapter_name="medical") == "medical"
        assert engine.list_adapters() == {"medical": str(tmp_path / "medical")}
        engine.set_adapter("medical")
        tuned = engine.run(prompt, max_new_tokens=8).generated_text
        assert tuned != plain
        engine.set_adapter(None)
        assert engine.run(prompt, max_new_tokens=8).generated_text == plain
    finally:
        if "medical" in engine.list_adapters():
            engine.unload_adapter("medical")
    assert engine.list_adapters() == {} and engine.run(prompt, max_new_tokens=8).generated_text == plain


# ---------------------------------------------------------------------------- the stream loop
@pytest.fixture(scope="module")
def cases(engine):
    """(kwargs, expected finish reason): max tokens, a stop string met mid-output, and a stop string that
    never matches but whose start is held back at the end until the request finishes."""
    base = engine.run("Hello, my name is", max_new_tokens=NEW, ignore_eos=True).generated_text
    assert len(base) > 12
    return [
        (dict(max_new_tokens=NEW, ignore_eos=True), "length"),
        (dict(max_new_tokens=NEW, ignore_eos=True, stop_sequences=[base[8:11]]), "stop"),
        (dict(max_new_tokens=NEW, ignore_eos=True, stop_sequences=[base[-2:] + "\x00never"]), "length"),
    ]


def _check_final(final, result):
    assert final is not None and final.token == "" and final.token_ids == () and final.logprobs == ()
    assert final.finish_reason == result.finish_reason and final.stats is not None
    assert final.stats.completion_tokens == result.stats.completion_tokens


def test_description_stream_loop_prints_exactly_run_text(engine, cases):
    prompt = "Hello, my name is"
    for kwargs, reason in cases:
        result = engine.run(prompt, **kwargs)
        assert result.finish_reason == reason
        chunks = list(engine.stream(prompt, **kwargs))
        printed, final = description_loop(chunks)
        assert printed == result.generated_text, kwargs
        _check_final(final, result)
        assert chunks[-1] is final and not any(c.is_final for c in chunks[:-1])
        assert all(c.finish_reason is None and c.stats is None for c in chunks[:-1])
        assert [t for c in chunks[:-1] for t in c.token_ids] == list(result.token_ids)
    # With logprobs, every entry is on a non-final chunk too.
    chunks = list(engine.stream(prompt, max_new_tokens=5, ignore_eos=True, logprobs=2))
    assert sum(len(c.logprobs) for c in chunks[:-1]) == 5 and chunks[-1].logprobs == ()


def test_description_loop_over_async_generate(engine, cases):
    """``async for chunk in engine.generate(...)`` inside ``engine.running()``: the same chunks."""
    expected = [engine.run("Hello, my name is", **kwargs) for kwargs, _ in cases]

    async def main():
        async with engine.running():
            for (kwargs, _), result in zip(cases, expected):
                chunks = [c async for c in engine.generate("Hello, my name is", **kwargs)]
                printed, final = description_loop(chunks)
                assert printed == result.generated_text, kwargs
                _check_final(final, result)

    engine.stop()  # the sync calls above started its background loop: hand the engine to this one
    anyio.run(main)


def test_cli_stream_prints_exactly_run_text(engine, cases, monkeypatch, capsys):
    """``llminfer stream``: the text, then one stats line naming the finish reason (the engine is the
    module's, lent to the CLI so that no second model loads)."""
    from llminfer.cli import generate, main

    @contextlib.contextmanager
    def lend(*_args, **_kwargs):
        yield engine

    monkeypatch.setattr(generate, "load_engine", lend)
    for kwargs, reason in cases:
        result = engine.run("Hello, my name is", **kwargs)
        args = ["stream", "Hello, my name is", "-n", str(NEW), "--ignore-eos", "--no-chat"]  # the raw prompt
        for stop in kwargs.get("stop_sequences", []):
            assert "," not in stop and "\\" not in stop  # --stop splits on commas and reads escapes
            args += ["--stop", stop]
        capsys.readouterr()
        main(args)
        out = capsys.readouterr().out
        text, stats = out.rsplit("\n", 2)[:2]
        assert text == result.generated_text and f"finish {reason}" in stats


# ---------------------------------------------------------------------------- HTTP SSE
def test_sse_streams_send_all_text_and_one_empty_finish_chunk(engine, cases):
    from llminfer.api import create_app, serve_in_thread

    def completion_kw(kwargs):
        kw = dict(max_tokens=kwargs["max_new_tokens"], temperature=0, extra_body={"ignore_eos": True})
        return {**kw, "stop": kwargs["stop_sequences"]} if "stop_sequences" in kwargs else kw

    messages = [{"role": "user", "content": "Hello"}]
    engine.stop()  # the server's lifespan runs it in its own loop
    with (serve_in_thread(create_app(engine)) as url,
          openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client):
        model = client.models.list().data[0].id
        for kwargs, reason in cases:
            kw = dict(model=model, **completion_kw(kwargs))
            full = client.completions.create(prompt="Hello, my name is", **kw).choices[0]
            assert full.finish_reason == reason
            chunks = list(client.completions.create(prompt="Hello, my name is", stream=True, **kw))
            assert "".join(c.choices[0].text for c in chunks) == full.text, kwargs
            finals = [c for c in chunks if c.choices[0].finish_reason is not None]
            assert finals == [chunks[-1]] and finals[0].choices[0].finish_reason == reason
            assert finals[0].choices[0].text == ""
            if reason != "stop":
                continue  # chat renders the same chunks: one case is enough there
            full_chat = client.chat.completions.create(messages=messages, **kw).choices[0]
            chat = list(client.chat.completions.create(messages=messages, stream=True, **kw))
            assert "".join(c.choices[0].delta.content or "" for c in chat) == full_chat.message.content
            finals = [c for c in chat if c.choices[0].finish_reason is not None]
            assert finals == [chat[-1]] and finals[0].choices[0].finish_reason == full_chat.finish_reason
            assert not finals[0].choices[0].delta.content
