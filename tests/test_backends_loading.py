"""Hugging Face loading controls: the token never shows up in logs, outputs, info, configs, artifacts or
errors; loading flags reach ``from_pretrained``; parallelism flags outside vLLM are refused."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from helpers import make_engine
from llminfer import Backend, ConfigError, EngineConfig, InferenceEngine, ModelLoadError
from llminfer.cli import main
from llminfer.logging import reset_logging
from llminfer.models.loading import cpu_native_half, hf_kwargs, resolve_dtype


@pytest.fixture(autouse=True)
def _reset_logging():
    """In-process CLI runs bind structlog to the captured stderr, closed after the test: reset it."""
    yield
    reset_logging()


TOKEN = "hf_DummyTokenValue1234567890abcdef"


def _assert_clean(*texts: str) -> None:
    for text in texts:
        assert TOKEN not in text
        assert TOKEN[3:20] not in text  # not even a slice of it


def test_token_never_in_cli_output_or_logs(qwen2_dir, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    common = ["--model", str(qwen2_dir), "--device", "cpu", "--dtype", "float32", "--hf-token", TOKEN,
              "--log-level", "debug"]
    main(["run", "hello", "--max-new-tokens", "4", "--json", *common])
    main(["stream", "hello", "--max-new-tokens", "4", *common])
    main(["info", "--json", *common])
    out, err = capsys.readouterr()
    _assert_clean(out, err, caplog.text)
    assert "engine loaded" in err  # the debug-level logs were on and captured
    facts = json.loads(out.strip().splitlines()[-1])
    _assert_clean(json.dumps(facts))


def test_token_never_in_info_config_or_repr(qwen2_dir):
    engine = make_engine(qwen2_dir, hf_token=TOKEN)
    with engine:
        result = engine.run("hi", max_new_tokens=2)
    cfg = engine.cfg
    assert cfg.to_dict()["hf_token"] == "***"
    _assert_clean(json.dumps(engine.info(), default=str), json.dumps(cfg.to_dict()), repr(cfg), str(cfg),
                  repr(result))
    assert EngineConfig.from_dict(cfg.to_dict()).hf_token == "***"  # an artifact never round-trips the secret
    assert hf_kwargs(cfg)["token"] == TOKEN  # ...but from_pretrained does get it


def test_token_never_in_load_errors(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError) as err:
        InferenceEngine(EngineConfig(model_name=missing, hf_token=TOKEN)).load()
    _assert_clean(str(err.value), repr(err.value))
    with pytest.raises(ModelLoadError) as err:  # a hub id, offline: transformers' own error text
        InferenceEngine(EngineConfig(model_name="llminfer-test/does-not-exist", hf_token=TOKEN,
                                     hf_local_files_only=True)).load()
    _assert_clean(str(err.value))
    with pytest.raises(SystemExit):
        main(["run", "x", "--model", "llminfer-test/does-not-exist", "--local-files-only", "--hf-token", TOKEN])
    out, err_text = capsys.readouterr()
    _assert_clean(out, err_text)
    assert err_text.startswith("error: ")


def test_loading_flags_reach_from_pretrained(tmp_path):
    cfg = EngineConfig(hf_revision="v1", hf_token=TOKEN, hf_local_files_only=True, hf_cache_dir=str(tmp_path),
                       hf_trust_remote_code=True)
    assert hf_kwargs(cfg) == {"revision": "v1", "local_files_only": True, "trust_remote_code": True,
                              "cache_dir": str(tmp_path), "token": TOKEN}
    assert hf_kwargs(EngineConfig()) == {"local_files_only": False, "trust_remote_code": False}


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_cli_parallelism_refused_naming_vllm(backend, capsys):
    with pytest.raises(SystemExit) as code:
        main(["run", "x", "--backend", backend, "--tp-size", "2"])
    assert code.value.code == 2  # an argument error, named by its flag
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--tp-size" in err and "vLLM backend" in err and err.count("\n") == 1
    with pytest.raises(ConfigError, match="vLLM backend"):
        EngineConfig(backend=Backend(backend), pp_size=2).validate()


# ---------------------------------------------------------------------------- dtype="auto" by the CPU
class _Config:
    def __init__(self, dtype):
        self.dtype = dtype


@pytest.mark.parametrize(
    ("checkpoint", "native", "expected"),
    [
        ("bfloat16", {"bfloat16": True, "float16": True}, torch.bfloat16),   # AVX-512 BF16 / AMX
        ("bfloat16", {"bfloat16": False, "float16": True}, torch.float16),   # native fp16 only
        ("bfloat16", {"bfloat16": False, "float16": False}, torch.float32),  # AVX2: half is emulated
        ("float16", {"bfloat16": False, "float16": False}, torch.float32),
        ("float32", {"bfloat16": True, "float16": True}, torch.float32),     # never below the checkpoint
        (None, {"bfloat16": True, "float16": True}, torch.float32),
    ],
)
def test_auto_dtype_follows_what_the_cpu_runs_natively(checkpoint, native, expected):
    dtype, reason = resolve_dtype(EngineConfig(), _Config(checkpoint), torch.device("cpu"), native_half=native)
    assert dtype == expected and reason.startswith("auto:")
    if checkpoint == "bfloat16" and expected == torch.float32:
        assert "no native bf16/fp16" in reason


@pytest.mark.parametrize(("weight_type", "native", "expected"), [
    ("Q4_1", {"bfloat16": True, "float16": True}, torch.bfloat16),  # quantized blocks: fp16 scales at most
    ("Q8_0", {"bfloat16": False, "float16": False}, torch.float32),
    ("BF16", {"bfloat16": True, "float16": False}, torch.bfloat16),
    ("F32", {"bfloat16": True, "float16": True}, torch.float32),  # a float32 GGUF stays float32
])
def test_a_gguf_folder_counts_as_its_files_precision(weight_type, native, expected):
    from llminfer.models.gguf import checkpoint_half_type

    half = checkpoint_half_type({"weight_type": weight_type})
    label = f"GGUF {weight_type}"
    dtype, reason = resolve_dtype(EngineConfig(), _Config("float32"), torch.device("cpu"), native_half=native,
                                  checkpoint=(half, label) if half else None)
    assert dtype == expected
    assert (label in reason) == (half is not None)


def test_explicit_dtype_and_gpu_keep_the_asked_or_checkpoint_dtype():
    none = {"bfloat16": False, "float16": False}
    assert resolve_dtype(EngineConfig(dtype="bfloat16"), _Config("float32"), torch.device("cpu"), none) == (
        torch.bfloat16, "bfloat16 (set)")
    assert resolve_dtype(EngineConfig(), _Config("bfloat16"), torch.device("cuda"), none)[0] == torch.bfloat16


def test_native_half_needs_both_onednn_and_the_instructions(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: True)
    assert cpu_native_half(frozenset({"avx2", "avx512f", "avx512_core"})) == {"bfloat16": False, "float16": False}
    assert cpu_native_half(frozenset({"avx512f", "avx512_bf16"})) == {"bfloat16": True, "float16": False}
    assert cpu_native_half(frozenset({"amx_bf16", "amx_fp16"})) == {"bfloat16": True, "float16": True}
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert cpu_native_half(frozenset({"avx512_bf16"}))["bfloat16"] is False


def test_info_says_which_dtype_and_why(qwen2_dir):
    engine = make_engine(qwen2_dir)
    assert engine.info()["dtype_reason"] == "float32 (set)"
    assert engine.info()["cpu_isa"].startswith(torch.backends.cpu.get_cpu_capability())


@pytest.mark.parametrize(
    ("flags", "onednn", "expected", "named"),
    [
        ({"avx2", "fma"}, (False, False), torch.float32, "no avx512_bf16/amx_bf16 CPU flag"),   # AVX2 only
        ({"avx512f", "avx512_bf16"}, (True, True), torch.bfloat16, "CPU flag avx512_bf16"),     # Cooper Lake+
        ({"amx_bf16", "amx_fp16", "avx512_fp16"}, (True, True), torch.bfloat16, "CPU flag amx_bf16"),
        ({"avx512_fp16"}, (False, True), torch.float16, "CPU flag avx512_fp16"),
        ({"avx512_bf16"}, (False, False), torch.float32, "oneDNN bfloat16 no"),  # flag, but oneDNN disagrees
    ],
)
def test_auto_dtype_reason_names_the_deciding_cpu_flags(monkeypatch, flags, onednn, expected, named):
    from llminfer.models import loading

    monkeypatch.setattr(loading, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn[0])
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: onednn[1])
    dtype, reason = resolve_dtype(EngineConfig(), _Config("bfloat16"), torch.device("cpu"))
    assert dtype == expected and named in reason, reason
    support = loading.cpu_half_support()
    assert support["half_flags"] == sorted(f for f in flags if f in {"avx512_bf16", "amx_bf16", "avx512_fp16",
                                                                     "amx_fp16"})


def test_benchmark_environment_records_the_auto_dtype_choice(monkeypatch):
    from llminfer.benchmark.environment import environment
    from llminfer.models import loading

    monkeypatch.setattr(loading, "cpu_flags", lambda: frozenset({"avx2"}))
    facts = environment()["cpu_dtype"]
    assert facts["auto_for_bf16_checkpoint"] == "float32" and facts["half_flags"] == []
    assert "no native bf16/fp16" in facts["auto_reason"] and facts["cpu_capability"] in facts["auto_reason"]


def test_engines_share_a_parsed_tokenizer_but_not_its_attributes(qwen2_dir, tmp_path, monkeypatch):
    """A second load of the same folder reuses the parsed (Rust) tokenizer without calling
    ``from_pretrained``; each copy keeps its own chat template; an edited tokenizer file is loaded afresh."""
    import shutil

    import transformers

    from llminfer.models.loading import clear_tokenizer_cache, load_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(qwen2_dir, folder)
    cfg = EngineConfig(model_name=str(folder))
    clear_tokenizer_cache()
    loads = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: loads.append(a) or real(*a, **k))
    first, second = load_tokenizer(str(folder), cfg), load_tokenizer(str(folder), cfg)
    assert len(loads) == 1
    assert first is not second and first._tokenizer is second._tokenizer
    assert first.encode("hello world") == second.encode("hello world")
    first.chat_template = "{{ 'changed' }}"
    assert second.chat_template != first.chat_template

    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 1234}))
    third = load_tokenizer(str(folder), cfg)
    assert len(loads) == 2 and third._tokenizer is not first._tokenizer
    assert third.model_max_length == 1234
    clear_tokenizer_cache()


def test_two_engines_sharing_a_tokenizer_serve_concurrent_threads_alike(qwen2_dir):
    """Two engines of one model (one parsed tokenizer between them) driven from two threads at once give
    what each gives alone: the shared Rust tokenizer is only read."""
    import threading

    from helpers import make_engine

    prompts = [f"request {i}: the quick brown fox" for i in range(6)]
    with make_engine(qwen2_dir) as a, make_engine(qwen2_dir) as b:
        assert a.tokenizer._tokenizer is b.tokenizer._tokenizer
        alone = [a.run(p, max_new_tokens=6).generated_text for p in prompts]
        together: dict[str, list[str]] = {}
        errors: list[BaseException] = []

        def drive(name, engine):
            try:
                together[name] = [engine.run(p, max_new_tokens=6).generated_text for p in prompts]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=drive, args=(n, e)) for n, e in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors and together == {"a": alone, "b": alone}


def test_a_revision_for_a_local_model_is_named_as_ignored(tmp_path):
    """transformers ignores ``revision`` for a folder: a revision given with the built-in model or a local
    folder gets a warning instead of nothing; a hub id gets none (its revision is used)."""
    import structlog

    from llminfer.models.loading import resolve_model_path

    with structlog.testing.capture_logs() as logs:
        resolve_model_path(EngineConfig(hf_revision="v2"))
        resolve_model_path(EngineConfig(model_name=str(tmp_path), hf_revision="v2"))
        resolve_model_path(EngineConfig(model_name="org/some-model", hf_revision="v2"))
    ignored = [e for e in logs if "hf_revision" in e["event"]]
    assert [e["model"] for e in ignored] == ["built-in", str(tmp_path)]
