"""Loading models and tokenizers through ``from_pretrained``, with the Hugging Face loading controls.

Transformers' own warnings and its weight-loading progress bar are off while llminfer loads (a library
should not draw on its user's terminal); they show when llminfer logs at debug level
(``LLMINFER_LOG_LEVEL=debug`` or ``--log-level debug``). See :func:`quiet_transformers`.
"""

from __future__ import annotations

import contextlib
import re
import threading
from pathlib import Path
from typing import Any

import torch

from llminfer.config import EngineConfig
from llminfer.errors import ConfigError, ModelLoadError
from llminfer.kernels.cpu_info import cpu_flags
from llminfer.logging import quiet_transformers

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(cfg: EngineConfig) -> str:
    """The folder or hub id to load: ``cfg.model_name``; the built-in tiny model for None, ``"builtin"`` or
    ``llminfer/tiny-qwen2`` (built on first use); for a ``.gguf`` file, or ``llminfer/smollm2-135m-instruct``
    (fetched on first use), the float32 folder converted from it and cached by content
    (:func:`llminfer.models.gguf.converted_path`).

    Raises:
        ModelLoadError: a GGUF file that does not exist or cannot be read or converted, or the trained
            built-in model that cannot be fetched.
    """
    from llminfer.models.builtin import BUILTIN_MODEL_NAME, builtin_model_path
    from llminfer.models.gguf import converted_path, is_gguf_name
    from llminfer.models.trained import TRAINED_MODEL_NAME, trained_gguf_path

    name = cfg.model_name
    local = name in (None, "", "builtin", BUILTIN_MODEL_NAME, TRAINED_MODEL_NAME) or is_gguf_name(name) \
        or Path(str(name)).expanduser().is_dir()
    if cfg.hf_revision and local:  # transformers ignores a revision for a folder; say so rather than nothing
        import structlog

        structlog.get_logger("llminfer.loading").warning(
            "hf_revision applies to a hub model id; ignored for this model", model=name or "built-in",
            revision=cfg.hf_revision)
    if name in (None, "", "builtin", BUILTIN_MODEL_NAME):
        return str(builtin_model_path())
    if name == TRAINED_MODEL_NAME:
        return str(converted_path(trained_gguf_path(fetch=not cfg.hf_local_files_only)))
    if is_gguf_name(name):
        return str(converted_path(Path(name).expanduser()))
    return name


def resolve_device(device: str) -> torch.device:
    """``"auto"`` → CUDA if available, else CPU.

    Raises:
        ConfigError: an unknown device string, or CUDA asked for without a CUDA device.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device: unknown device {device!r} (use cpu, cuda, cuda:N or auto)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: {device!r} asked for but no CUDA device is available")
    return dev


def hf_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    """The ``from_pretrained`` keyword arguments from the ``hf_*`` fields (token included, never logged)."""
    kw: dict[str, Any] = {
        "revision": cfg.hf_revision,
        "local_files_only": cfg.hf_local_files_only,
        "trust_remote_code": cfg.hf_trust_remote_code,
    }
    if cfg.hf_cache_dir:
        kw["cache_dir"] = cfg.hf_cache_dir
    if cfg.hf_token:
        kw["token"] = cfg.hf_token
    return {k: v for k, v in kw.items() if v is not None}


def load_config(path: str, cfg: EngineConfig):
    """Load the model's ``PretrainedConfig``.

    Raises:
        ModelLoadError: the folder or id does not exist or cannot be reached.
    """
    from transformers import AutoConfig

    if not Path(path).expanduser().exists():
        check_hub_id(path, cfg)
    try:
        with quiet_transformers():
            return AutoConfig.from_pretrained(path, **hf_kwargs(cfg))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; one clear message
        raise ModelLoadError(f"cannot load model {path!r}: {_first_line(exc)}") from exc


#: A Hugging Face model id: ``name`` or ``org/name`` (letters, digits, ``-``, ``_``, ``.``; at most 96 each).
_HUB_ID = re.compile(r"[\w.-]{1,96}(/[\w.-]{1,96})?")
_hub_state: dict[str, bool] = {}  # "reachable": the result of the one probe a process makes


def check_hub_id(name: str, cfg: EngineConfig) -> None:
    """For a model name with no local folder behind it, before transformers looks it up on the hub (which
    retries an unreachable hub for about half a minute): refuse a name that cannot be a hub id (a path,
    ``a/b/c``); else say at once, as a warning on stderr, that there is no local folder of that name and it
    is being looked up on the hub; and where the hub's host does not resolve (one probe per process, at most
    3 s) and the id is not in the local Hugging Face cache, fail at once.

    Raises:
        ModelLoadError: the name is no local folder and no hub id, or the hub cannot be reached and the id
            is not cached.
    """
    import structlog

    if name.startswith(("/", ".", "~")) or not _HUB_ID.fullmatch(name) or ".." in name or "--" in name:
        raise ModelLoadError(f"model folder {name!r} does not exist (no local folder of that name, and it is not "
                             "a Hugging Face model id)")
    if cfg.hf_local_files_only or _env_offline():
        return
    structlog.get_logger("llminfer.loading").warning(
        f"no local folder {name!r}: looking it up as a Hugging Face hub model id (pass --local-files-only, "
        "hf_local_files_only=True, to never go online)")
    if not hub_reachable() and not _in_hf_cache(name, cfg):
        raise ModelLoadError(f"no local folder {name!r}, the Hugging Face hub cannot be reached, and it is not in "
                             "the local Hugging Face cache (check the name; --local-files-only never goes online)")


def _in_hf_cache(repo_id: str, cfg: EngineConfig) -> bool:
    """Whether the Hugging Face cache holds the repo's ``config.json`` (at ``cfg.hf_revision``)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cfg.hf_cache_dir,
                                       revision=cfg.hf_revision)
    except Exception:  # noqa: BLE001 - an odd id or cache: let transformers decide
        return True
    return isinstance(found, str)


def _env_offline() -> bool:
    import os

    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub's host name (``$HF_ENDPOINT`` or huggingface.co) resolves; asked once per
    process (a DNS lookup in a daemon thread, at most ``timeout_s`` seconds), then remembered."""
    if "reachable" in _hub_state:
        return _hub_state["reachable"]
    import os
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    answer: list[bool] = []

    def probe() -> None:
        try:
            socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
            answer.append(True)
        except OSError:
            answer.append(False)

    t = threading.Thread(target=probe, daemon=True, name="llminfer-hub-probe")
    t.start()
    t.join(timeout_s)
    _hub_state["reachable"] = bool(answer and answer[0])
    return _hub_state["reachable"]


#: The CPU flags (``/proc/cpuinfo`` names) that make each half type native: without one, oneDNN emulates it
#: through fp32 conversions, which is much slower than fp32 itself.
HALF_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def cpu_half_support(flags: frozenset[str] | None = None) -> dict[str, Any]:
    """What decides ``dtype="auto"`` on this CPU, for ``llminfer info`` and benchmark artifacts.

    Args:
        flags: CPU flags (default: :func:`cpu_flags`); where none are known, oneDNN's answer alone counts.

    Returns:
        ``{"cpu_capability": torch's ISA level (e.g. "AVX2"), "half_flags": the flags of :data:`HALF_FLAGS`
        present (sorted), "onednn": {"bfloat16": bool, "float16": bool}, "native": {"bfloat16": bool,
        "float16": bool}}``: native when oneDNN reports the type usable *and* the CPU has the instructions.
    """
    flags = cpu_flags() if flags is None else flags
    ops = torch.ops.mkldnn
    try:
        onednn = {"bfloat16": bool(ops._is_mkldnn_bf16_supported()), "float16": bool(ops._is_mkldnn_fp16_supported())}
    except (AttributeError, RuntimeError):
        onednn = {"bfloat16": False, "float16": False}
    native = dict(onednn) if not flags else {
        half: onednn[half] and bool(flags & set(names)) for half, names in HALF_FLAGS.items()}
    present = sorted(f for names in HALF_FLAGS.values() for f in names if f in flags)
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "half_flags": present,
            "onednn": onednn, "native": native}


def cpu_native_half(flags: frozenset[str] | None = None) -> dict[str, bool]:
    """Whether this CPU computes bf16 / fp16 matmuls natively (``cpu_half_support(flags)["native"]``):
    oneDNN reports the type usable *and* the CPU has the instructions (AVX-512 BF16 or AMX-BF16; AVX-512
    FP16 or AMX-FP16).

    Returns:
        ``{"bfloat16": bool, "float16": bool}``.
    """
    return cpu_half_support(flags)["native"]


def _why_half(support: dict[str, Any], half: str) -> str:
    """One clause naming what made ``half`` native or not, e.g. ``"CPU flag avx512_bf16, oneDNN bf16 yes"``."""
    have = [f for f in HALF_FLAGS[half] if f in support["half_flags"]]
    flags = f"CPU flag {'/'.join(have)}" if have else f"no {'/'.join(HALF_FLAGS[half])} CPU flag"
    return f"{flags}, oneDNN {half} {'yes' if support['onednn'][half] else 'no'}"


def resolve_dtype(cfg: EngineConfig, model_config: Any, device: torch.device,
                  native_half: dict[str, bool] | None = None,
                  checkpoint: tuple[str, str] | None = None) -> tuple[torch.dtype, str]:
    """The weights' dtype, and why it was chosen.

    ``cfg.dtype`` when set. For ``"auto"``: on GPU, the checkpoint's dtype (float32 when it names none);
    on CPU, a half-precision checkpoint runs in bfloat16 where the CPU has native bf16, else float16 where
    it has native fp16, else float32: emulated half precision makes batched steps and prefill (compute-bound)
    about 2.4x slower than fp32 on an AVX2 CPU, although batch-1 decode (bandwidth-bound) is faster in
    bf16, which reads half the bytes (measured on the 114M bench model; pass ``dtype="bfloat16"`` for
    single-stream latency there).

    Args:
        native_half: the CPU's native half types (default: :func:`cpu_native_half`; injected in tests).
        checkpoint: ``(dtype name, label)`` where the config's dtype is not the checkpoint's precision: a GGUF
            file's folder is float32, its weights a half type or quantized blocks with fp16 scales
            (:func:`llminfer.models.gguf.checkpoint_half_type`); the label names it in the reason.

    Returns:
        ``(dtype, reason)``, the reason one line for ``llminfer info`` and benchmark artifacts.
    """
    if cfg.dtype != "auto":
        return _DTYPES[cfg.dtype], f"{cfg.dtype} (set)"
    dt = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = _DTYPES.get(dt)
    if dt not in _DTYPES.values():
        dt = torch.float32
    name = str(dt).replace("torch.", "")
    if checkpoint is not None:
        dt, name = _DTYPES[checkpoint[0]], checkpoint[1]
    if device.type != "cpu" or dt == torch.float32:
        return dt, f"auto: the checkpoint's {name}"
    if native_half is None:
        support = cpu_half_support()
    else:  # injected: the flags are implied by the answer
        support = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "onednn": dict(native_half),
                   "native": native_half,
                   "half_flags": [HALF_FLAGS[h][0] for h in HALF_FLAGS if native_half[h]]}
    native = support["native"]
    for half in ("bfloat16", "float16"):
        if native[half]:
            return _DTYPES[half], (f"auto: {name} checkpoint, and this CPU computes {half} natively "
                                   f"({_why_half(support, half)})")
    return torch.float32, (f"auto: {name} checkpoint, but this CPU has no native bf16/fp16 "
                           f"({support['cpu_capability']}; {_why_half(support, 'bfloat16')}; "
                           f"{_why_half(support, 'float16')}): float32 runs batched steps faster")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")
_tokenizers: dict[tuple, Any] = {}
_tokenizers_lock = threading.Lock()


def _tokenizer_key(path: str, cfg: EngineConfig) -> tuple | None:
    """What identifies a loaded tokenizer: the folder, the loading options and the size and modification
    time of its files (so an edited tokenizer is loaded afresh). None for a hub id: not cached."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    files = []
    for name in _TOKENIZER_FILES:
        with contextlib.suppress(OSError):
            st = (folder / name).stat()
            files.append((name, st.st_size, st.st_mtime_ns))
    options = tuple(sorted((k, str(v)) for k, v in hf_kwargs(cfg).items() if k != "token"))
    return str(folder.resolve()), options, tuple(files)


def load_tokenizer(path: str, cfg: EngineConfig):
    """Load the tokenizer (a fast one when available).

    Engines of one process that load the same local tokenizer share its parsed vocabulary: each gets a
    shallow copy (its own chat template and attributes) of one loaded instance, whose Rust tokenizer the
    copies share. Parsing Qwen2's 151k-token ``tokenizer.json`` takes about 2 s on CPU, most of the load of
    a small model (``compare``, benchmark suites and tests load several engines). Sharing is safe because
    encode and decode only read the Rust tokenizer; llminfer never changes its truncation or padding.
    :func:`clear_tokenizer_cache` drops the loaded ones.

    Raises:
        ModelLoadError: no tokenizer in the folder or id.
    """
    import copy

    from transformers import AutoTokenizer

    key = _tokenizer_key(path, cfg)
    with _tokenizers_lock:
        if key is not None and key in _tokenizers:
            return copy.copy(_tokenizers[key])
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(path, **hf_kwargs(cfg))
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot load the tokenizer of {path!r}: {_first_line(exc)}") from exc
    if key is None:
        return tokenizer
    with _tokenizers_lock:
        _tokenizers[key] = tokenizer
    return copy.copy(tokenizer)


def clear_tokenizer_cache() -> None:
    """Forget the tokenizers :func:`load_tokenizer` keeps for reuse (the engines using them keep theirs)."""
    with _tokenizers_lock:
        _tokenizers.clear()


def load_model(path: str, cfg: EngineConfig, dtype: torch.dtype, device: torch.device,
               attn_implementation: str | None = None, quantization_config: Any = None):
    """Load the causal LM in eval mode on ``device``; with a weight-only ``cfg.quant.mode`` its linear layers
    are quantized after loading (:func:`llminfer.models.quant.apply_weight_only`).

    Raises:
        ModelLoadError: loading failed (missing weights, unsupported architecture, ...).
        ConfigError: a weight-only quantization mode off the CPU.
    """
    from transformers import AutoModelForCausalLM

    kw = hf_kwargs(cfg)
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    if quantization_config is not None:
        kw["quantization_config"] = quantization_config
        kw["device_map"] = {"": device}
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot load model {path!r}: {_first_line(exc)}") from exc
    if quantization_config is None:
        model = model.to(device)
    model.eval()
    if cfg.quant.mode.weight_only:
        from llminfer.models.quant import apply_weight_only

        apply_weight_only(model, cfg.quant)
    return model


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
