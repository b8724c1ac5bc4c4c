"""GGUF files as models: read through transformers' GGUF support, cached on disk as an ordinary folder.

``EngineConfig(model_name="path/to/model.gguf")`` (``--model path/to/model.gguf``) loads the file with
``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)``, which dequantizes every tensor to float32,
and takes the tokenizer, chat template and EOS from the same file. Such a model refuses ``save_pretrained``,
so its ``state_dict`` is copied into a model built from its config, and that one is saved, with the
tokenizer and generation config, as a Hugging Face folder under ``$LLMINFER_CACHE_DIR/gguf/<sha256>``: the
first load of a file converts it (tens of seconds for a 135M model), every later one reads that folder
(the engine then loads it in its own dtype, like any checkpoint).

The cache is keyed by the file's content (sha256). Hashing a file is paid once: its digest is stored with
the file's size and modification time, and reused while both stay the same.

The GGUF header (architecture, file type, tensor types) is read with the ``gguf`` package (llama.cpp's own
reader), never parsed here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from llminfer.errors import ConfigError, ModelLoadError

GGUF_SUFFIX = ".gguf"
CACHE_SUBDIR = "gguf"
_INFO_TAG = "v1"  # bump when read_gguf_info's facts change: stored ones are then read again
_CONVERTED_TAG = "v2"  # bump when the conversion recipe below changes: old folders are then rebuilt
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "llminfer_gguf.json")

#: GGUF tensor types that llminfer's weight-only modes reproduce (``--quant from-gguf``): Q8_0 (blocks of
#: 32, one fp16 scale) onto int8-wo (per-channel int8), Q4_0 / Q4_1 (blocks of 32, a scale and for Q4_1 a
#: minimum) onto int4-wo with groups of 32 (a scale and a zero point per group, the form of Q4_1).
WEIGHT_ONLY_EQUIVALENT = {"Q8_0": "int8-wo", "Q4_0": "int4-wo", "Q4_1": "int4-wo"}
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def is_gguf_name(name: str | None) -> bool:
    """Whether a model name names a GGUF file (ends in ``.gguf``, any case)."""
    return bool(name) and str(name).lower().endswith(GGUF_SUFFIX)


def read_gguf_info(path: str | os.PathLike, cache_dir: Path | None = None) -> dict[str, Any]:
    """The GGUF file's header facts, read with ``gguf.GGUFReader`` (memory-mapped; the tensors are not read),
    once per (path, size, modification time).

    The reader parses every metadata field, the tokenizer's vocabulary and merges included, in Python: about
    2 s for the built-in SmolLM2 file, paid two or three times per start (the command line's ``--quant auto``,
    the converted folder's lookup, ``from-gguf``). So the facts are stored in ``cache_dir/gguf/info/`` (default
    ``$LLMINFER_CACHE_DIR``) next to the size and ``st_mtime_ns`` they were read at, as :func:`file_digest`
    stores digests, and reused while both are unchanged.

    Returns:
        ``{"file": absolute path, "bytes": file size, "architecture": general.architecture (e.g. "llama"),
        "name": general.name or None, "file_type": the file's type without llama.cpp's ``MOSTLY_`` prefix
        (e.g. "Q4_1"; from ``general.file_type``, else the most common quantized tensor type),
        "tensor_types": {type name: tensor count}, "weight_type": the type of most 2-D tensors (the linear
        weights), "context_length": ``<arch>.context_length`` or None}``.

    Raises:
        ModelLoadError: the file is missing or is not a GGUF file the reader understands.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    from llminfer.models.builtin import default_cache_dir

    resolved = path.resolve()
    st = resolved.stat()
    stamp = {"path": str(resolved), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "tag": _INFO_TAG}
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    record = cache_dir / CACHE_SUBDIR / "info" / (hashlib.sha256(str(resolved).encode()).hexdigest()[:24] + ".json")
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(record.read_text())
        if all(saved[key] == value for key, value in stamp.items()) and isinstance(saved["info"], dict):
            return saved["info"]
    info = _parse_gguf_info(path)
    with contextlib.suppress(OSError):  # a read-only cache only loses the fast path
        record.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(record, json.dumps({**stamp, "info": info}))
    return info


def _parse_gguf_info(path: Path) -> dict[str, Any]:
    """:func:`read_gguf_info`'s facts, parsed from the file (an existing one)."""
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - a main dependency
        raise ModelLoadError(f"reading GGUF files needs the gguf package (pip install gguf): {exc}") from None
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError, struct errors, ...
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file: {exc}") from None

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        if f is None:
            return None
        try:
            return f.contents()
        except Exception:  # noqa: BLE001 - an odd field type: treat as absent
            return None

    arch = field("general.architecture") or "?"
    types = Counter(t.tensor_type.name for t in reader.tensors)
    weight_types = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2 and t.shape[0] > 1)
    weight_type = weight_types.most_common(1)[0][0] if weight_types else None
    file_type = None
    ft = field("general.file_type")
    if isinstance(ft, int):
        try:
            file_type = gguf.LlamaFileType(ft).name.removeprefix("MOSTLY_")
        except ValueError:
            file_type = f"file type {ft}"
    if file_type is None:
        file_type = weight_type or "?"
    return {
        "file": str(path.resolve()),
        "bytes": path.stat().st_size,
        "architecture": str(arch),
        "name": field("general.name"),
        "file_type": file_type,
        "tensor_types": dict(types.most_common()),
        "weight_type": weight_type,
        "context_length": field(f"{arch}.context_length"),
    }


def check_architecture(info: dict[str, Any]) -> None:
    """Raise ModelLoadError naming the architecture when transformers cannot load it from GGUF."""
    import transformers

    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # pragma: no cover - a transformers without GGUF support
        raise ModelLoadError(f"transformers {transformers.__version__} cannot load GGUF files") from None
    arch = info["architecture"]
    # transformers reads a few architectures under other names (its load_gguf_checkpoint renames these)
    aliases = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
               "t5encoder": "t5"}
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and aliases.get(arch) not in GGUF_SUPPORTED_ARCHITECTURES:
        readable = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
        raise ModelLoadError(f"GGUF file {info['file']!r}: transformers {transformers.__version__} cannot load "
                             f"the GGUF architecture {arch!r} (it reads: {readable})")


def file_digest(path: str | os.PathLike, cache_dir: Path) -> str:
    """The sha256 (hex) of a file's content, computed once per (path, size, modification time).

    The digest is stored in ``cache_dir/gguf/digests/`` next to the size and ``st_mtime_ns`` it was taken at;
    while both are unchanged the stored one is returned (the fast path: one ``stat``), otherwise the file is
    hashed again (about 0.3 s per 100 MB).
    """
    path = Path(path).expanduser().resolve()
    st = path.stat()
    record_dir = cache_dir / CACHE_SUBDIR / "digests"
    record = record_dir / (hashlib.sha256(str(path).encode()).hexdigest()[:24] + ".json")
    with contextlib.suppress(OSError, ValueError, KeyError):
        saved = json.loads(record.read_text())
        if saved["path"] == str(path) and saved["size"] == st.st_size and saved["mtime_ns"] == st.st_mtime_ns:
            return str(saved["sha256"])
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    with contextlib.suppress(OSError):  # a read-only cache only loses the fast path
        record_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(record, json.dumps({"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                          "sha256": digest}))
    return digest


def converted_path(gguf_file: str | os.PathLike, cache_dir: Path | None = None) -> Path:
    """The cached Hugging Face folder of a GGUF file (built on first use by :func:`convert_gguf`).

    Args:
        gguf_file: the ``.gguf`` file.
        cache_dir: llminfer's cache folder (default ``$LLMINFER_CACHE_DIR`` or ``~/.cache/llminfer``).

    Returns:
        ``<cache_dir>/gguf/<first 20 hex digits of the file's sha256>-v2``, holding float32 safetensors,
        ``config.json``, ``generation_config.json`` (the file's EOS), the tokenizer with its chat template,
        and ``llminfer_gguf.json`` (what it was made from: :func:`read_gguf_info`'s facts).

    Raises:
        ModelLoadError: the file is missing, unreadable, of an architecture transformers cannot read from
            GGUF, or the conversion failed; OSError: the cache folder cannot be written.
    """
    from llminfer.models.builtin import default_cache_dir

    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    info = read_gguf_info(gguf_file, cache_dir)
    dest = cache_dir / CACHE_SUBDIR / f"{file_digest(info['file'], cache_dir)[:20]}-{_CONVERTED_TAG}"
    if all((dest / name).is_file() for name in _REQUIRED_FILES):
        return dest
    check_architecture(info)
    if dest.exists():  # a folder we did not finish (we rename complete ones into place): rebuild it
        shutil.rmtree(dest, ignore_errors=True)
    convert_gguf(info, dest)
    return dest


def convert_gguf(info: dict[str, Any], dest: Path) -> Path:
    """Dequantize the GGUF file ``info["file"]`` (from :func:`read_gguf_info`) into a float32 Hugging Face
    folder at ``dest``, built in a temporary folder next to it and renamed into place (so readers never see
    half a model; if another process finished ``dest`` meanwhile, its copy is kept).

    Raises:
        ModelLoadError: transformers failed to read the file (the message names the architecture).
    """
    import sys
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llminfer.logging import quiet_transformers, status

    file = Path(info["file"])
    folder, name = str(file.parent), file.name
    start = time.monotonic()
    # one line on stderr, like the fetch: the first load of a file takes tens of seconds
    print(f"llminfer: converting {name} ({info['architecture']}, {info['file_type']}) once to a float32 folder in "
          f"{dest} ...", file=sys.stderr, flush=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        with status(f"converting {name} ..."), quiet_transformers(), _quiet_gguf_bar():
            try:
                gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; one clear message
                text = (str(exc).strip() or type(exc).__name__).splitlines()[0][:300]
                raise ModelLoadError(f"cannot load GGUF file {str(file)!r} (architecture {info['architecture']!r}, "
                                     f"{info['file_type']}): {text}") from exc
            # The GGUF-loaded model refuses save_pretrained: an ordinary model of the same config takes its
            # weights (tied ones stay tied: load_state_dict writes the shared tensor once per name).
            config = gguf_model.config
            config.architectures = [type(gguf_model).__name__]
            config.dtype = torch.float32
            # The weights saved are plain floats: a leftover GgufConfig would make transformers refuse another
            # quantization of the folder (bitsandbytes) and llama.cpp's converter refuse the folder.
            if getattr(config, "quantization_config", None) is not None:
                del config.quantization_config
            with torch.device("meta"):
                plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            plain.load_state_dict(gguf_model.state_dict(), assign=True)
            if getattr(config, "tie_word_embeddings", False):
                plain.tie_weights()
            plain.generation_config = gguf_model.generation_config
            plain.save_pretrained(tmp)
            context = getattr(config, "max_position_embeddings", None)
            if context:
                tokenizer.model_max_length = context
            tokenizer.save_pretrained(tmp)
            del gguf_model, plain
        (tmp / "llminfer_gguf.json").write_text(json.dumps(info, indent=1))
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not all((dest / n).is_file() for n in _REQUIRED_FILES):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"llminfer: converted {name} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return dest


@contextlib.contextmanager
def _quiet_gguf_bar():
    """transformers draws its GGUF dequantizing bar with plain tqdm, which its progress-bar switch does not
    reach: inside this block that bar is off too, unless llminfer logs at debug level (as
    :func:`llminfer.logging.quiet_transformers`)."""
    import logging

    from llminfer.logging import current_level

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None or current_level() <= logging.DEBUG:
        yield
        return
    gguf_utils.tqdm = lambda *args, **kw: bar(*args, **{**kw, "disable": True})
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def source_info(model_path: str, gguf_file: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """The GGUF facts a converted folder was made from (its ``llminfer_gguf.json``), None for other folders.

    Args:
        model_path: the folder loaded.
        gguf_file: the ``.gguf`` file this load was given. Its absolute path replaces the recorded
            ``"file"``: the folder is keyed by the file's content, so every copy of one file shares it, and
            the recorded path is only the copy that happened to be converted first.
    """
    try:
        info = json.loads((Path(model_path) / "llminfer_gguf.json").read_text())
    except (OSError, ValueError):
        return None
    if gguf_file is not None:
        info["file"] = str(Path(gguf_file).expanduser().resolve())  # as read_gguf_info writes it
    return info


def checkpoint_half_type(info: dict[str, Any]) -> str | None:
    """The half type a GGUF file's weights fit in, for ``dtype="auto"``: ``"float16"`` for F16 and for quantized
    blocks (Q8_0, Q4_1, K-quants: small integers times fp16 scales, whose rounding to a half type is far below
    their own), ``"bfloat16"`` for BF16, None for F32 / F64 (the converted folder is float32 either way, so
    without this every GGUF would count as an fp32 checkpoint)."""
    kind = info.get("weight_type") or info.get("file_type")
    if kind in ("F32", "F64") or not isinstance(kind, str):
        return None
    return "bfloat16" if kind == "BF16" else "float16"


def weight_only_mode(info: dict[str, Any]) -> str:
    """``--quant from-gguf``: the llminfer quantization mode that keeps a GGUF file's weights quantized.

    Returns:
        ``"int8-wo"`` (Q8_0), ``"int4-wo"`` (Q4_0, Q4_1) or ``"none"`` (float files: nothing to keep). The
        weights are first dequantized, then quantized again in that mode, whose groups of 32 find the file's
        blocks again: Q8_0's scales and Q4_1's scales and minima come back exactly, kept in float16 on
        llminfer's kernels (Q4_1 where a block's minimum and maximum are among its 16 levels, where llama.cpp's
        quantizer puts them).

    Raises:
        ConfigError: the file's weight type has no weight-only equivalent (K-quants and others).
    """
    kind = info.get("weight_type") or info.get("file_type")
    if kind in WEIGHT_ONLY_EQUIVALENT:
        return WEIGHT_ONLY_EQUIVALENT[kind]
    if kind in _FLOAT_TYPES:
        return "none"
    known = ", ".join(f"{k} -> {v}" for k, v in WEIGHT_ONLY_EQUIVALENT.items())
    raise ConfigError(f"quant.mode from-gguf: the GGUF's weights are {kind}, which no llminfer weight-only mode "
                      f"reproduces ({known}); choose int8-wo, int4-wo or none")


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
