"""Shared fixtures: random-weight test models built once per session (untied embeddings, fixed seeds),
``fake_vllm``: ``Backend.VLLM`` engines on :class:`helpers.FakeVLLM` instead of vLLM, and the trained model
(``trained_gguf``, ``trained_model``: SmolLM2-135M-Instruct, through llminfer's own fetch and cache; they skip
where it cannot be had)."""

from __future__ import annotations

import os

# Triton reads this when it first decorates functions (its own helpers included): set before anything
# imports triton, so the Triton attention kernels can run on CPU tensors in its interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The command line's default model is the trained llminfer/smollm2-135m-instruct (fetched once); the tests that
# run commands without --model (subprocesses inherit this) stay on the random tiny model: offline and fast.
# The tests that need the trained model take the trained_gguf / trained_model fixtures below.
os.environ["LLMINFER_DEFAULT_MODEL"] = "llminfer/tiny-qwen2"

from pathlib import Path  # noqa: E402
from types import SimpleNamespace

import pytest
import torch

from helpers import FakeVLLM
from llminfer.backends import vllm as vb
from llminfer.models import build_random_model

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Sizes chosen so that greedy continuations are varied (checked in test_builtin_model) and HF generate
# on a few hundred tokens takes well under a second.
_SPECS = {
    "llama": dict(architecture="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, seed=1),
    "qwen2": dict(architecture="qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, seed=2),
    "gpt2": dict(architecture="gpt2", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=3),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_random_model(root / name, **spec) for name, spec in _SPECS.items()}


@pytest.fixture(scope="session")
def qwen2_dir(model_dirs) -> Path:
    return model_dirs["qwen2"]


@pytest.fixture
def fake_vllm(monkeypatch) -> FakeVLLM:
    """Every ``Backend.VLLM`` engine loaded during the test runs on one :class:`FakeVLLM` (reporting 4
    cached prompt tokens per request); vLLM itself is never imported."""
    fake = FakeVLLM(cached=4)
    monkeypatch.setattr(vb, "require_vllm", lambda: SimpleNamespace(__version__="fake"))
    monkeypatch.setattr(vb.VLLMBackend, "from_config", classmethod(
        lambda cls, cfg, path, max_len: cls(fake, dict, lambda ids: {"prompt_token_ids": ids}, "fake")))
    return fake


@pytest.fixture(scope="session")
def trained_gguf() -> str:
    """The trained built-in model's GGUF file (SmolLM2-135M-Instruct, Q4_1), fetched into
    ``$LLMINFER_CACHE_DIR`` once (``.ci/run`` does it before pytest); skips where it cannot be had."""
    from llminfer.errors import ModelLoadError
    from llminfer.models.trained import TRAINED_MODEL_NAME, trained_gguf_path

    try:
        return str(trained_gguf_path())
    except ModelLoadError as exc:
        pytest.skip(f"the trained model {TRAINED_MODEL_NAME} cannot be had here: {exc}")


@pytest.fixture(scope="session")
def trained_model(trained_gguf) -> str:
    """The trained model dequantized to a local Hugging Face folder (float32 safetensors, tokenizer, chat
    template, generation config with its EOS): what llminfer loads for ``llminfer/smollm2-135m-instruct``,
    usable as ``EngineConfig(model_name=...)`` and ``AutoModelForCausalLM.from_pretrained(...)``. Converted
    once per cache (tens of seconds), then read from it; skips where that fails."""
    from llminfer.errors import ModelLoadError
    from llminfer.models.gguf import converted_path

    try:
        return str(converted_path(trained_gguf))
    except (ModelLoadError, OSError) as exc:
        pytest.skip(f"the trained model cannot be converted from {trained_gguf}: {exc}")
