"""Shared fixtures: random-weight test models built once per session (untied embeddings, fixed seeds), and
``fake_vllm``: ``Backend.VLLM`` engines on :class:`helpers.FakeVLLM` instead of vLLM."""

from __future__ import annotations

import os

# Triton reads this when it first decorates functions (its own helpers included): set before anything
# imports triton, so the Triton attention kernels can run on CPU tensors in its interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

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


# ---------------------------------------------------------------------------- TEMPORARY (issue 34)
# TEMPORARY stand-ins for the ``trained_gguf`` / ``trained_model`` fixtures that the GGUF branch provides
# (the built-in trained model fetched once per session). Same names and contract: a str path, skipping with
# a clear reason where the model cannot be had. The lead replaces this block when merging that branch.
def _trained_from_env(var: str, what: str) -> str:
    value = os.environ.get(var)
    if not value:
        pytest.skip(f"no trained model: set {var} to {what}")
    if not Path(value).exists():
        pytest.skip(f"no trained model: {var}={value} does not exist")
    return value


@pytest.fixture(scope="session")
def trained_gguf() -> str:
    """TEMPORARY: path of the SmolLM2-135M-Instruct Q4_1 GGUF, from ``LLMINFER_TEST_TRAINED_GGUF``."""
    return _trained_from_env("LLMINFER_TEST_TRAINED_GGUF", "the SmolLM2-135M-Instruct .gguf file")


@pytest.fixture(scope="session")
def trained_model() -> str:
    """TEMPORARY: a local HF folder of that model (fp32 safetensors, tokenizer, chat template), from
    ``LLMINFER_TEST_TRAINED_MODEL``."""
    return _trained_from_env("LLMINFER_TEST_TRAINED_MODEL", "a local HF folder of SmolLM2-135M-Instruct")
