"""Tests for the built-in tokenizer asset and the random-weight model builder."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llminfer.models import builtin
from llminfer.models.builtin import (
    BUILTIN_MODEL_NAME,
    build_random_model,
    builtin_model_path,
    extract_builtin_tokenizer,
)

IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643
TINY = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return extract_builtin_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_name():
    assert BUILTIN_MODEL_NAME == "llminfer/tiny-qwen2"


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "  two leading spaces\n\ttab and newline",
        "你好，世界！我想在apple工作",
        "Cửa Việt нещо на Български",
        "emoji 🦙🚀 😶‍🌫️ ✅",
        "",
    ],
)
def test_tokenizer_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize(
    ("text", "ids"),
    [  # from llama.cpp's ggml-vocab-qwen2.gguf.out
        ("Hello world", [9707, 1879]),
        (" this is 🦙.cpp", [419, 374, 11162, 99, 247, 13, 10821]),
        ("333333333", [18, 18, 18, 18, 18, 18, 18, 18, 18]),
        (
            "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
            [
                9707,
                11,
                379,
                64848,
                0,
                2585,
                525,
                498,
                26525,
                223,
                937,
                104100,
                18493,
                22377,
                99257,
                16,
                18,
                16,
                19,
                16,
                20,
                16,
                35727,
                21216,
            ],
        ),
    ],
)
def test_tokenizer_matches_llama_cpp(tokenizer, text, ids):
    assert tokenizer.encode(text, add_special_tokens=False) == ids


def test_special_tokens(tokenizer):
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]) == [
        IM_START,
        IM_END,
        ENDOFTEXT,
    ]
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(tokenizer.all_special_tokens)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.encode("a<|im_end|>b", add_special_tokens=False) == [64, IM_END, 65]
    assert tokenizer.decode([64, IM_END, 65], skip_special_tokens=True) == "ab"
    assert tokenizer.encode("Hi") == [13048]  # no BOS added


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 你好<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[1:], tokenize=False)
    assert no_prompt.endswith("<|im_start|>user\nHi 你好<|im_end|>\n")
    assert no_prompt.startswith("<|im_start|>system\n")  # default system prompt


@pytest.mark.parametrize("architecture", ["qwen2", "llama", "gpt2"])
def test_build_random_model_generates(tmp_path, tokenizer_dir, architecture):
    dest = build_random_model(
        tmp_path / architecture, architecture=architecture, tokenizer_dir=tokenizer_dir, **TINY
    )
    assert (dest / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp folder cleaned up
    model = AutoModelForCausalLM.from_pretrained(dest)
    tok = AutoTokenizer.from_pretrained(dest)
    assert model.config.model_type == architecture
    assert model.config.vocab_size == len(tok)
    assert model.get_input_embeddings().weight.data_ptr() != model.get_output_embeddings().weight.data_ptr()
    assert model.generation_config.eos_token_id == [IM_END, ENDOFTEXT]
    assert model.generation_config.pad_token_id == ENDOFTEXT
    assert tok.model_max_length == TINY["max_position_embeddings"]

    enc = tok("The quick brown fox", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    assert len(new) == 12
    assert len(set(new)) >= 3, new


def test_build_is_deterministic_and_dtype(tmp_path, tokenizer_dir):
    a = build_random_model(tmp_path / "a", tokenizer_dir=tokenizer_dir, **TINY)
    b = build_random_model(tmp_path / "b", tokenizer_dir=tokenizer_dir, dtype="bfloat16", **TINY)
    ma, mb = AutoModelForCausalLM.from_pretrained(a), AutoModelForCausalLM.from_pretrained(b)
    assert mb.dtype == torch.bfloat16
    wa, wb = ma.get_input_embeddings().weight, mb.get_input_embeddings().weight
    assert torch.equal(wa.to(torch.bfloat16), wb)


def test_build_rejects_bad_arguments(tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match="architecture"):
        build_random_model(tmp_path / "m", architecture="mamba")
    with pytest.raises(ValueError, match="dtype"):
        build_random_model(tmp_path / "m", dtype="int8")
    with pytest.raises(ValueError, match="vocab_size"):
        build_random_model(tmp_path / "m", tokenizer_dir=tokenizer_dir, vocab_size=1000, **TINY)
    assert not list(tmp_path.iterdir())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        build_random_model(tmp_path / "full", tokenizer_dir=tokenizer_dir, **TINY)


def test_build_keeps_folder_that_appeared_meanwhile(tmp_path, tokenizer_dir, monkeypatch):
    dest = tmp_path / "m"
    real_rename = os.rename

    def other_process_wins(src, dst):
        os.mkdir(dst)
        (dest / "config.json").write_text("{}")
        real_rename(src, dst)  # fails: dst is not empty

    monkeypatch.setattr(builtin.os, "rename", other_process_wins)
    assert build_random_model(dest, tokenizer_dir=tokenizer_dir, **TINY) == dest
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert [p.name for p in dest.iterdir()] == ["config.json"]


def test_builtin_model_path_is_idempotent(tmp_path, monkeypatch):
    path = builtin_model_path(tmp_path)
    assert path == tmp_path / "tiny-qwen2-v1"
    model = AutoModelForCausalLM.from_pretrained(path)
    assert (model.config.model_type, model.config.hidden_size, model.config.num_hidden_layers) == (
        "qwen2",
        64,
        2,
    )
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    assert (model.config.intermediate_size, model.config.max_position_embeddings) == (192, 2048)
    assert not model.config.tie_word_embeddings
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt the built-in model")

    monkeypatch.setattr(builtin, "build_random_model", no_rebuild)
    assert builtin_model_path(tmp_path) == path
    monkeypatch.setenv("LLMINFER_CACHE_DIR", str(tmp_path))
    assert builtin_model_path() == path
