"""Loading: everything an engine needs before it can assemble its core, as one :class:`Runtime`.

``load_runtime(cfg)`` resolves the model folder, reads its config, picks the device, dtype and context
length, loads the tokenizer, the model (with llminfer's paged attention registered), an optional
speculative-decoding assistant, and sizes and allocates the paged KV cache
(:func:`llminfer.kv.sizing.plan_num_blocks`). With the vLLM backend, the model and KV cache are vLLM's:
the runtime then holds the tokenizer and config only (llminfer still tokenizes and validates).
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import structlog
import torch

from llminfer.backends.attention import PagedKVCache, register_paged_attention
from llminfer.backends.registry import backend_spec, backends_with, titles_with
from llminfer.config import EngineConfig, QuantMode
from llminfer.errors import ConfigError
from llminfer.kv.manager import KVCacheManager
from llminfer.kv.sizing import kv_geometry, plan_num_blocks
from llminfer.models.loading import (
    load_config,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from llminfer.sampling.structured import GrammarCompiler

log = structlog.get_logger("llminfer.runtime")


@attrs.define
class Runtime:
    """The loaded pieces of an engine.

    Attributes:
        model_path: the resolved model folder (or hub id, for vLLM).
        model_config: the transformers config.
        device, dtype: where and in which dtype the weights live; dtype_reason: why that dtype (one line).
        max_model_len: context length in tokens.
        tokenizer: the Hugging Face tokenizer.
        eos_token_ids: ids that end a request (generation config and tokenizer).
        model: the causal LM (None with vLLM).
        kv_cache, kv_manager: paged KV tensors and their block bookkeeping (None with vLLM).
        draft_model, draft_cache: the speculative-decoding assistant and its KV tensors, or None.
        load_time_s: seconds spent loading the weights.
        grammar_compiler: compiles structured-output constraints for this tokenizer (None with vLLM,
            which compiles its own).
        attention_backend: the paged-attention kernels, resolved from ``cfg.attention_backend``
            (``"triton"``, ``"torch"``, or ``"cpu"``: llminfer's CPU decode kernel, which ``"auto"`` picks
            for fp32 on CPU with the eager or compiled backend where :mod:`llminfer.kernels.build` builds).
        kv_sizing: on CUDA without an explicit KV budget, the profiling run's measurement (bytes:
            ``total_bytes``, ``used_bytes``, ``activation_peak_bytes``; and ``gpu_memory_utilization``).
        cpu_kernel_layers: how many linear layers run on llminfer's CPU kernel
            (:mod:`llminfer.kernels.build`; 0 off CPU, with it off, or where it cannot be built).
        gguf: for a model loaded from a GGUF file, the file's facts
            (:func:`llminfer.models.gguf.read_gguf_info`; ``file`` is the file given, see
            :func:`~llminfer.models.gguf.source_info`); None otherwise.
    """

    model_path: str
    model_config: Any
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    tokenizer: Any
    eos_token_ids: tuple[int, ...] = ()
    model: Any = None
    kv_cache: PagedKVCache | None = None
    kv_manager: KVCacheManager | None = None
    draft_model: Any = None
    draft_cache: PagedKVCache | None = None
    load_time_s: float = 0.0
    dtype_reason: str = ""
    #: ``dtype="auto"`` settled by measurement (llminfer.models.dtype_probe): the figures, the choice, and
    #: whether they were measured now or cached; None where the flag rule decided alone.
    dtype_probe: dict[str, Any] | None = None
    grammar_compiler: GrammarCompiler | None = None
    attention_backend: str = "torch"
    kv_sizing: dict[str, Any] | None = None
    cpu_kernel_layers: int = 0
    gguf: dict[str, Any] | None = None

    @property
    def vocab_size(self) -> int | None:
        """The config's vocabulary size (token ids must be below it), None when it has none."""
        return getattr(self.model_config.get_text_config(), "vocab_size", None)

    @property
    def lm_head_prepacked(self) -> bool:
        """Whether the LM head runs on a oneDNN-prepacked weight (see :mod:`llminfer.kernels.prepack`)."""
        from llminfer.kernels.prepack import PrepackedLinear

        return self.model is not None and isinstance(self.model.get_output_embeddings(), PrepackedLinear)


def load_runtime(cfg: EngineConfig) -> Runtime:
    """Load what ``cfg`` names.

    Raises:
        ConfigError: inconsistent settings (speculative decoding on a backend without it, a context longer
            than the model's, a KV budget that holds no block, an assistant with another vocabulary).
        ModelLoadError: the model, tokenizer or assistant cannot be found or loaded.
        BackendUnavailableError: the backend cannot run here (vLLM is not installed, say).
    """
    spec = backend_spec(cfg.backend)
    if not spec.speculative and (cfg.assistant_model_name or cfg.speculative_method == "ngram"):
        what, flag = (("assistant_model_name (speculative decoding)", "--assistant-model") if cfg.assistant_model_name
                      else ("speculative_method 'ngram' (prompt lookup)", "--spec-method"))
        others = " or ".join(f"--backend {b}" for b in backends_with("speculative"))
        raise ConfigError(f"{what} runs on the {titles_with('speculative')} backend only; "
                          f"drop {flag} or use {others}")
    spec.check_available()  # fail at once, before anything is loaded
    if spec.external_engine:  # it loads the model and owns the KV cache: llminfer needs the tokenizer only
        rt = _config_and_tokenizer(cfg, resolve_device(cfg.device))
        eos = rt.tokenizer.eos_token_id
        rt.eos_token_ids = (eos,) if isinstance(eos, int) else ()
        return rt
    device = resolve_device(cfg.device)
    quantization_config = None
    if cfg.quant.mode is not QuantMode.NONE:
        from llminfer.models.quant import bnb_config

        quantization_config = bnb_config(cfg.quant, device)
    rt = _config_and_tokenizer(cfg, device)
    from llminfer.backends.triton_attention import resolve_attention_backend

    rt.attention_backend = resolve_attention_backend(cfg.attention_backend, device)
    register_paged_attention()
    t0 = time.perf_counter()
    if _should_probe_dtype(cfg, rt, device):
        _probe_dtype(rt, cfg, device, quantization_config)
    else:
        _install_model(rt, cfg, device, *_prepare_model(rt, cfg, device, rt.dtype, quantization_config))
    rt.load_time_s = time.perf_counter() - t0
    rt.eos_token_ids = _eos_ids(rt.model, rt.tokenizer)
    layers, kv_heads, head_dim = kv_geometry(rt.model.config)
    cache_cfg = cfg.cache
    block_size = cache_cfg.page_size_tokens if cache_cfg.enable_paged_kv else rt.max_model_len
    gpu_profile = None
    if device.type == "cuda" and cache_cfg.num_blocks is None and cache_cfg.kv_cache_memory_bytes is None:
        gpu_profile = _profile_step(rt, cfg, (layers, kv_heads, head_dim), block_size)
        rt.kv_sizing = dict(gpu_profile, gpu_memory_utilization=cache_cfg.gpu_memory_utilization)
    num_blocks = plan_num_blocks(cfg, (layers, kv_heads, head_dim), block_size, rt.max_model_len, rt.dtype, device,
                                 gpu_profile)
    rt.kv_cache = PagedKVCache(layers, num_blocks, block_size, kv_heads, head_dim, rt.dtype, device)
    rt.kv_manager = KVCacheManager(num_blocks, block_size,
                                   enable_prefix_cache=cache_cfg.enable_prefix_cache and cache_cfg.enable_paged_kv)
    if cfg.assistant_model_name:
        _load_draft(cfg, rt)
    rt.grammar_compiler = GrammarCompiler(rt.tokenizer, logits_width(rt.model),
                                          rt.eos_token_ids, timeout_s=cfg.grammar_compile_timeout_s)
    log.info("engine loaded", model=rt.model_path, device=str(device), dtype=str(rt.dtype),
             kv_blocks=num_blocks, block_size=block_size)
    return rt


def _prepare_model(rt: Runtime, cfg: EngineConfig, device: torch.device, dtype: torch.dtype,
                   quantization_config: Any) -> tuple[Any, int, str]:
    """Load the model in ``dtype`` and prepare it as the backend runs it (llminfer's CPU kernels, the
    prepacked head). Returns ``(model, cpu_kernel_layers, attention_backend)``."""
    model = load_model(rt.model_path, cfg, dtype, device, attn_implementation="llminfer_paged",
                       quantization_config=quantization_config)
    kernel_layers = 0
    attention_backend = rt.attention_backend
    spec = backend_spec(cfg.backend)
    if cfg.cpu_kernels and spec.cpu_fast_path and device.type == "cpu":
        from llminfer.kernels.build import skinny_linear_available
        from llminfer.models.kernel_swap import enable_cpu_kernels

        kernel_layers = enable_cpu_kernels(model, include_head=spec.cpu_lm_head == "kernel")
        if (cfg.attention_backend == "auto" and attention_backend == "torch"
                and dtype in (torch.float32, torch.bfloat16) and skinny_linear_available()):
            attention_backend = "cpu"
    from llminfer.models.weight_only import drop_kernel_grids

    drop_kernel_grids(model)
    if cfg.cpu_prepack_lm_head and spec.cpu_lm_head == "prepacked":
        from llminfer.kernels.prepack import PrepackedLinear, head_kernel_rows, prepack_lm_head

        prepack_lm_head(model)
        head = model.get_output_embeddings()
        if isinstance(head, PrepackedLinear) and kernel_layers:
            head.kernel_rows = head_kernel_rows(head)
    return model, kernel_layers, attention_backend


def logits_width(model: Any) -> int:
    """The number of logits the model's output head gives per token: its ``out_features`` (a weight-only layer
    keeps its weight in a kernel's blocked layout, whose first dimension is not the vocabulary), else its
    weight's rows."""
    head = model.get_output_embeddings()
    width = getattr(head, "out_features", None)
    return int(width) if isinstance(width, int) else int(head.weight.shape[0])


def _install_model(rt: Runtime, cfg: EngineConfig, device: torch.device, model: Any, kernel_layers: int,
                   attention_backend: str) -> None:
    rt.model = model
    rt.cpu_kernel_layers = kernel_layers
    rt.attention_backend = attention_backend


def _should_probe_dtype(cfg: EngineConfig, rt: Runtime, device: torch.device) -> bool:
    """Whether ``dtype="auto"`` is settled by measurement here (see :mod:`llminfer.models.dtype_probe`)."""
    from llminfer.models.dtype_probe import probe_enabled

    return (cfg.dtype == "auto" and device.type == "cpu" and rt.dtype in (torch.bfloat16, torch.float16)
            and cfg.quant.mode is QuantMode.NONE and backend_spec(cfg.backend).cpu_fast_path
            and probe_enabled() and _fits_twice(rt, cfg))


def _fits_twice(rt: Runtime, cfg: EngineConfig) -> bool:
    """The fp32 copy takes at most a quarter of the available memory (both candidates load at once)."""
    from llminfer.models.quant import unquantized_weight_bytes

    try:
        _, fp32_bytes = unquantized_weight_bytes(rt.model_config, torch.float32, cfg.hf_trust_remote_code)
        with open("/proc/meminfo", encoding="ascii") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, Exception):  # noqa: BLE001 - unknown: do not measure
        return False
    return fp32_bytes * 4 <= avail


def _probe_dtype(rt: Runtime, cfg: EngineConfig, device: torch.device, quantization_config: Any) -> None:
    """Settle ``dtype="auto"`` between the flag rule's half type and float32 by timing both (or from the
    cache of an earlier measurement), install the faster model and say why in ``rt.dtype_reason``."""
    from llminfer.models import dtype_probe as dp

    flag_dtype = rt.dtype
    flag_name = str(flag_dtype).replace("torch.", "")
    settings = f"kernels={int(cfg.cpu_kernels)}/screen={int(cfg.cpu_argmax_screen)}"
    key = f"{dp.cpu_key()}|{dp.shape_key(rt.model_config, torch.get_num_threads(), settings)}"
    record = dp.cached_choice(key)
    if record is not None and record.get("choice") in ("float32", flag_name):
        chosen = getattr(torch, record["choice"])
        _install_model(rt, cfg, device, *_prepare_model(rt, cfg, device, chosen, quantization_config))
        how = "cached measurement"
    else:
        try:
            models, figures = dp.measure_dtypes(
                [flag_dtype, torch.float32],
                lambda dt: (lambda m: (m, m[2]))(_prepare_model(rt, cfg, device, dt, quantization_config)), device,
                timer=lambda prepared, dt, attn, dev: dp.time_model(prepared[0], dt, attn, dev,
                                                                     argmax_screen=cfg.cpu_argmax_screen))
        except Exception as exc:  # noqa: BLE001 - the flag rule stands
            log.warning("dtype measurement failed; keeping the flag rule's choice", error=str(exc))
            _install_model(rt, cfg, device, *_prepare_model(rt, cfg, device, flag_dtype, quantization_config))
            rt.dtype_probe = {"error": str(exc)}
            return
        name = dp.pick(figures, flag_name)
        chosen = getattr(torch, name)
        _install_model(rt, cfg, device, *models[chosen][0])
        models.clear()
        record = {"choice": name, "flag_choice": flag_name, "figures": figures, "measured_at": time.time()}
        dp.store_choice(key, record)
        how = "measured"
    rt.dtype = chosen
    rt.dtype_probe = {**record, "source": how, "key": key}
    figs = ", ".join(f"{k} {v['prefill_ms']:.1f} ms prefill {dp.PREFILL_TOKENS} + {v['decode_step_ms']:.2f} ms/decode "
                     f"step, {v.get('greedy_step_ms', v['decode_step_ms']):.2f} greedy"
                     for k, v in record["figures"].items())
    rt.dtype_reason = (f"auto: {str(chosen).replace('torch.', '')} by {how} ({figs}; the flag rule said "
                       f"{flag_name}: {rt.dtype_reason.removeprefix('auto: ')})")


def _profile_step(rt: Runtime, cfg: EngineConfig, geometry: tuple[int, int, int], block_size: int) -> dict[str, int]:
    """nano-vllm's profiling run: the largest step (``max_num_batched_tokens`` prompt tokens of one
    sequence, logits for ``max_batch_size`` rows) on dummy tokens and a scratch KV cache, measured by
    :func:`llminfer.kv.sizing.profile_gpu_memory`."""
    from llminfer.backends.packing import run_packed
    from llminfer.kv.sizing import profile_gpu_memory

    num_tokens = max(1, min(cfg.scheduler.max_num_batched_tokens, rt.max_model_len))
    layers, kv_heads, head_dim = geometry

    def step() -> int:
        blocks = -(-num_tokens // block_size)
        scratch = PagedKVCache(layers, blocks, block_size, kv_heads, head_dim, rt.dtype, rt.device)
        keep = list(range(max(0, num_tokens - cfg.max_batch_size), num_tokens))
        run_packed(rt.model, scratch, [[0] * num_tokens], [0], [list(range(blocks))], keep, rt.device,
                   rt.attention_backend)
        nbytes = scratch.nbytes
        del scratch
        return nbytes

    return profile_gpu_memory(step, rt.device)


def _config_and_tokenizer(cfg: EngineConfig, device: torch.device) -> Runtime:
    model_path = resolve_model_path(cfg)
    model_config = load_config(model_path, cfg)
    from llminfer.models.gguf import checkpoint_half_type, is_gguf_name, source_info

    given_gguf = cfg.model_name if is_gguf_name(cfg.model_name) else None  # info names the user's file
    gguf = source_info(model_path, given_gguf)
    # weight-only modes keep float32 activations: their CPU kernels take fp32 rows (bf16 rows ran 30 % slower)
    half = checkpoint_half_type(gguf) if gguf and cfg.quant.mode is QuantMode.NONE else None
    dtype, dtype_reason = resolve_dtype(cfg, model_config, device, checkpoint=(
        (half, f"GGUF {gguf.get('weight_type') or gguf.get('file_type')} ({half} at most)") if half else None))
    if gguf and cfg.quant.mode.weight_only and checkpoint_half_type(gguf) and cfg.dtype == "auto":
        dtype_reason = (f"auto: float32, the GGUF file's folder as loaded, kept under {cfg.quant.mode.value}: "
                        "weight-only kernels take float32 rows")
    model_max = getattr(model_config.get_text_config(), "max_position_embeddings", None) or 2048
    if cfg.max_model_len is not None and cfg.max_model_len > model_max:
        raise ConfigError(f"max_model_len {cfg.max_model_len} exceeds the model's context of {model_max} tokens")
    return Runtime(model_path=model_path, model_config=model_config, device=device, dtype=dtype,
                   max_model_len=cfg.max_model_len or model_max, tokenizer=load_tokenizer(model_path, cfg),
                   dtype_reason=dtype_reason, gguf=gguf)


def resolve_quant(cfg: EngineConfig) -> EngineConfig:
    """``cfg`` with ``quant.mode`` ``from-gguf`` replaced by the weight-only mode matching its GGUF file
    (:func:`llminfer.models.gguf.weight_only_mode`: Q8_0 -> int8-wo, Q4_0/Q4_1 -> int4-wo, float -> none),
    as a copy; any other ``cfg`` unchanged. Reads the GGUF header only (the trained built-in model is
    fetched first if need be).

    Raises:
        ConfigError: ``from-gguf`` for a model that is no GGUF file, or a GGUF type with no such mode.
        ModelLoadError: the GGUF file cannot be read or fetched.
    """
    if cfg.quant.mode is not QuantMode.FROM_GGUF:
        return cfg
    from llminfer.models.gguf import is_gguf_name, read_gguf_info, weight_only_mode
    from llminfer.models.trained import TRAINED_MODEL_NAME, trained_gguf_path

    name = cfg.model_name or ""
    if name == TRAINED_MODEL_NAME:
        file = str(trained_gguf_path(fetch=not cfg.hf_local_files_only))
    elif is_gguf_name(name):
        file = name
    else:
        raise ConfigError(f"quant.mode from-gguf needs a .gguf model (or {TRAINED_MODEL_NAME}); "
                          f"{name or 'the built-in tiny model'!r} is none: choose int8-wo, int4-wo, nf4, ...")
    mode = weight_only_mode(read_gguf_info(file))
    head = {} if mode == QuantMode.INT4_WO.value else {"int4_lm_head": "int8"}  # int4-wo's alone
    return attrs.evolve(cfg, quant=attrs.evolve(cfg.quant, mode=QuantMode(mode), **head))


def _load_draft(cfg: EngineConfig, rt: Runtime) -> None:
    """The assistant model for speculative decoding; its KV shares the target's block tables."""
    name = cfg.assistant_model_name
    path = resolve_model_path(EngineConfig(model_name=None if name == "builtin" else name))
    load_config(path, cfg)  # a clear error for a missing folder
    draft = load_model(path, cfg, rt.dtype, rt.device, attn_implementation="llminfer_paged")
    if cfg.cpu_kernels and rt.device.type == "cpu":
        from llminfer.models.kernel_swap import enable_cpu_kernels

        enable_cpu_kernels(draft)
    from llminfer.models.weight_only import drop_kernel_grids

    drop_kernel_grids(draft)
    if cfg.cpu_prepack_lm_head:
        from llminfer.kernels.prepack import prepack_lm_head

        prepack_lm_head(draft)
    target_vocab, draft_vocab = logits_width(rt.model), logits_width(draft)
    if target_vocab != draft_vocab:
        raise ConfigError(f"the assistant model {cfg.assistant_model_name!r} has a vocabulary of {draft_vocab} "
                          f"tokens, the model {target_vocab}: speculative decoding needs one tokenizer for both")
    layers, kv_heads, head_dim = kv_geometry(draft.config)
    assert rt.kv_manager is not None
    rt.draft_model = draft
    rt.draft_cache = PagedKVCache(layers, rt.kv_manager.num_blocks, rt.kv_manager.block_size, kv_heads, head_dim,
                                  rt.dtype, rt.device)


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    for source in (eos, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.append(source)
        elif isinstance(source, (list, tuple)):
            ids.extend(int(x) for x in source)
    return tuple(dict.fromkeys(ids))
