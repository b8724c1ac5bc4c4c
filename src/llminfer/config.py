"""Engine configuration: attrs classes with validators, and a cattrs converter for artifacts.

Every class validates on construction *and* on attribute assignment (``cfg.cache.page_size_tokens = 0``
raises at once). Cross-field rules are checked by :meth:`EngineConfig.validate`, which the engine calls
when it loads.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import attrs
import cattrs
from attrs import validators as v

from llminfer.backends.registry import Backend, backend_spec, backends_with, titles_with
from llminfer.errors import ConfigError


class QuantMode(str, enum.Enum):
    """Weight quantization: bitsandbytes (``nf4``, ``fp4``, ``int8``), or weight-only int8 / int4 on torch's
    CPU kernels (``int8-wo``, ``int4-wo``; see :mod:`llminfer.models.weight_only`), or for a GGUF model the
    one of those its file's type maps to (``from-gguf``)."""

    NONE = "none"
    NF4 = "nf4"
    FP4 = "fp4"
    INT8 = "int8"
    INT8_WO = "int8-wo"
    INT4_WO = "int4-wo"
    #: A GGUF model: the weight-only mode matching the file's type (Q8_0 -> int8-wo, Q4_0/Q4_1 -> int4-wo,
    #: float -> none), resolved at load (:func:`llminfer.runtime.resolve_quant`).
    FROM_GGUF = "from-gguf"

    @property
    def weight_only(self) -> bool:
        """Whether this is one of the CPU weight-only modes (not bitsandbytes)."""
        return self in (QuantMode.INT8_WO, QuantMode.INT4_WO)


DTYPES = ("auto", "float32", "bfloat16", "float16")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
SPECULATIVE_METHODS = ("draft_model", "ngram")
SCHEDULING_POLICIES = ("fcfs", "priority")


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value!r}")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value < 0:
        raise ConfigError(f"{attribute.name} must be >= 0, got {value!r}")


def _fraction(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{attribute.name} must be in (0, 1], got {value!r}")


def _one_of(choices: tuple[str, ...]):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise ConfigError(f"{attribute.name} must be one of {', '.join(choices)}; got {value!r}")

    return check


def _int4_only(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value != attribute.default and instance.mode not in (QuantMode.INT4_WO, QuantMode.FROM_GGUF):
        raise ConfigError(f"{attribute.name} {value!r} applies to int4-wo (or from-gguf's Q4 files) only; "
                          f"mode is {instance.mode.value}")


def _enum(enum_cls: type[enum.Enum]):
    """Accept an enum member or its value (``"nf4"``), reject anything else with a ConfigError."""

    def convert(value: Any) -> Any:
        if isinstance(value, enum_cls):
            return value
        try:
            return enum_cls(str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in enum_cls)
            raise ConfigError(f"unknown {enum_cls.__name__} {value!r}; choose one of {names}") from None

    return convert


def _typed(*types: type):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) and bool not in types:
            raise ConfigError(f"{attribute.name} must be {types[0].__name__}, got {value!r}")
        if not isinstance(value, types):
            raise ConfigError(f"{attribute.name} must be {types[0].__name__}, got {value!r}")

    return check


_int = _typed(int)
_opt_int = v.optional(_typed(int))
def _num(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A finite int or float: an infinite batch timeout would hold every request back forever, and NaN
    passes every comparison's ``not``."""
    _typed(int, float)(instance, attribute, value)
    if not math.isfinite(value):
        raise ConfigError(f"{attribute.name} must be a finite number, got {value!r}")


_bool = _typed(bool)


@attrs.define(kw_only=True)
class CacheConfig:
    """KV cache layout and budget.

    Attributes:
        enable_paged_kv: KV lives in fixed-size blocks of ``page_size_tokens`` tokens. When False, each
            sequence gets one contiguous region of ``max_model_len`` tokens (the pre-paging layout, kept
            for comparison); prefix caching is then off.
        page_size_tokens: tokens per KV block (the vLLM ``block_size``).
        enable_prefix_cache: reuse the KV blocks of identical prompt prefixes (automatic prefix caching).
        kv_cache_memory_bytes: the KV pool's budget in bytes. ``None``: on CPU enough for
            ``max_batch_size`` full-length sequences, capped at 2 GiB; on CUDA what a profiling step leaves
            (see ``gpu_memory_utilization``).
        gpu_memory_utilization: fraction of the whole GPU the engine may use (vLLM's meaning): the KV pool
            gets ``total × gpu_memory_utilization − memory in use (weights, CUDA context, other processes)
            − the largest step's peak activations``, measured by a profiling run at load (CUDA only).
        num_blocks: an exact block count, overriding both budgets (tests and benchmarks).
    """

    enable_paged_kv: bool = attrs.field(default=True, validator=_bool)
    page_size_tokens: int = attrs.field(default=16, validator=[_int, _positive])
    enable_prefix_cache: bool = attrs.field(default=True, validator=_bool)
    kv_cache_memory_bytes: int | None = attrs.field(default=None, validator=[_opt_int, _positive])
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=[_num, _fraction])
    num_blocks: int | None = attrs.field(default=None, validator=[_opt_int, _positive])


def _int8_group(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value not in (0, 32, 64, 128, 256):
        raise ConfigError(f"{attribute.name} must be one of 0 (per output channel), 32, 64, 128, 256; got {value!r}")


def _int4_group(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value not in (32, 64, 128, 256):
        raise ConfigError(f"{attribute.name} must be one of 32, 64, 128, 256 (torch's int4 kernel); got {value!r}")


@attrs.define(kw_only=True)
class QuantConfig:
    """Weight quantization (``QuantConfig(mode=QuantMode.NF4, double_quant=True)``,
    ``QuantConfig(mode="int8-wo")``).

    Attributes:
        mode: see :class:`QuantMode`.
        double_quant: bitsandbytes 4-bit only: quantize the block statistics again.
        compute_dtype: the matmuls' activation dtype. Weight-only modes: torch's CPU kernels are vectorized
            for bfloat16 activations only (float32 is exact but takes a scalar loop).
        int4_group_size: ``int4-wo``: input columns per scale/zero point (32, 64, 128, 256; 32 as
            llama.cpp's Q4_0). Layers whose ``in_features`` it does not divide stay unquantized.
        quantize_lm_head: weight-only modes: quantize the LM head too (default on: in small models it is
            the largest matrix read every decode step, e.g. 78M of the bench model's 102M parameters). With
            tied embeddings the input embedding keeps its float weight; the head gets a quantized copy.
            bitsandbytes modes never quantize it (as transformers does).
        int8_group_size: ``int8-wo`` (and an int8 LM head): input columns per scale and minimum (32, 64,
            128, 256; 32 as llama.cpp's Q8_0, the default), each group on the closer of an asymmetric and a
            symmetric grid (:mod:`llminfer.kernels.int8_group_linear`); 0 for one scale per output channel (fewer
            bytes, coarser: on trained weights it flips several times more top-1 tokens).
        int4_lm_head: ``int4-wo``: the LM head's format, ``"int8"`` (default: int8-wo's format; it flips the
            fewest top-1 tokens), ``"int6"`` (6-bit groups of 32, :mod:`llminfer.models.weight_only_int6`: the
            head's bits of llama.cpp's Q4_0 files, which keep the output matrix at 6 bits, Q6_K; three quarters
            of int8's bytes; ``"int8"`` where llminfer's CPU kernel does not load) or ``"int4"`` (group-wise
            like the other layers: half the bytes of 8 bits, many more flips). Other than ``"int8"`` only
            with ``mode`` ``int4-wo`` or ``from-gguf`` (where a Q8_0 file's int8-wo ignores it), else a
            ConfigError.
    """

    mode: QuantMode = attrs.field(default=QuantMode.NONE, converter=_enum(QuantMode))
    double_quant: bool = attrs.field(default=False, validator=_bool)
    compute_dtype: str = attrs.field(default="bfloat16", validator=_one_of(DTYPES[1:]))
    int4_group_size: int = attrs.field(default=32, validator=[_int, _int4_group])
    quantize_lm_head: bool = attrs.field(default=True, validator=_bool)
    int4_lm_head: str = attrs.field(default="int8", validator=[_one_of(("int8", "int6", "int4")), _int4_only])
    int8_group_size: int = attrs.field(default=32, validator=[_int, _int8_group])


@attrs.define(kw_only=True)
class SchedulerConfig:
    """Continuous-batching scheduler knobs (token-budget scheduling in the style of vLLM v1).

    Attributes:
        max_num_batched_tokens: tokens computed in one engine step, over all sequences.
        long_prefill_token_threshold: cap on prompt tokens one request may compute in one step
            (chunked prefill); 0 means no cap beyond the step budget.
        watermark: fraction of KV blocks kept free when admitting a waiting request, so that running
            requests can grow without immediate preemption.
        policy: ``"fcfs"`` (arrival order) or ``"priority"`` (lower ``priority`` value first, then arrival).
    """

    max_num_batched_tokens: int = attrs.field(default=2048, validator=[_int, _positive])
    long_prefill_token_threshold: int = attrs.field(default=0, validator=[_int, _non_negative])
    watermark: float = attrs.field(default=0.01, validator=[_num, _non_negative])
    policy: str = attrs.field(default="fcfs", validator=_one_of(SCHEDULING_POLICIES))


@attrs.define(kw_only=True)
class EngineConfig:
    """Everything the engine needs to load a model and serve requests.

    ``EngineConfig()`` with no ``model_name`` uses the built-in tiny model (random weights, a real Qwen2
    tokenizer), so everything runs offline. ``model_name`` is a Hugging Face model id or a local folder.

    Raises:
        ConfigError: a value is out of range or unknown (the message names the field), or
            :meth:`validate` finds an inconsistent combination.
    """

    model_name: str | None = attrs.field(default=None, validator=v.optional(_typed(str)))
    backend: Backend = attrs.field(default=Backend.EAGER, converter=_enum(Backend))
    dtype: str = attrs.field(default="auto", validator=_one_of(DTYPES))
    device: str = attrs.field(default="auto", validator=_typed(str))
    max_batch_size: int = attrs.field(default=16, validator=[_int, _positive])
    batch_timeout_ms: float = attrs.field(default=5.0, validator=[_num, _non_negative])
    max_model_len: int | None = attrs.field(default=None, validator=[_opt_int, _positive])
    seed: int = attrs.field(default=0, validator=_int)
    enable_tracing: bool = attrs.field(default=True, validator=_bool)
    served_model_name: str | None = attrs.field(default=None, validator=v.optional(_typed(str)))
    #: A structured-output grammar still compiling after this many seconds fails its request.
    grammar_compile_timeout_s: float = attrs.field(default=10.0, validator=[_num, _positive])

    cache: CacheConfig = attrs.field(factory=CacheConfig, validator=v.instance_of(CacheConfig))
    quant: QuantConfig = attrs.field(factory=QuantConfig, validator=v.instance_of(QuantConfig))
    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig, validator=v.instance_of(SchedulerConfig))

    hf_revision: str | None = attrs.field(default=None, validator=v.optional(_typed(str)))
    hf_token: str | None = attrs.field(default=None, validator=v.optional(_typed(str)), repr=False)
    hf_local_files_only: bool = attrs.field(default=False, validator=_bool)
    hf_cache_dir: str | None = attrs.field(default=None, validator=v.optional(_typed(str)))
    hf_trust_remote_code: bool = attrs.field(default=False, validator=_bool)

    assistant_model_name: str | None = attrs.field(default=None, validator=v.optional(_typed(str)))
    speculative_num_assistant_tokens: int = attrs.field(default=5, validator=[_int, _positive])
    speculative_confidence_threshold: float = attrs.field(default=0.4, validator=[_num, _non_negative])
    #: How drafts are made: ``"draft_model"`` (``assistant_model_name``) or ``"ngram"`` (prompt lookup: drafts
    #: copied from earlier in the sequence, no second model; :class:`~llminfer.backends.speculative.PromptLookupBackend`).
    #: None: ``"draft_model"`` when ``assistant_model_name`` is set, else no speculation.
    speculative_method: str | None = attrs.field(default=None, validator=v.optional(_one_of(SPECULATIVE_METHODS)))
    #: Prompt lookup: the longest and shortest suffix n-grams matched (tokens).
    speculative_prompt_lookup_max: int = attrs.field(default=4, validator=[_int, _positive])
    speculative_prompt_lookup_min: int = attrs.field(default=2, validator=[_int, _positive])

    compile_mode: str = attrs.field(default="default", validator=_one_of(COMPILE_MODES))
    compile_cudagraphs: bool = attrs.field(default=False, validator=_bool)
    compile_fallback_to_eager: bool = attrs.field(default=True, validator=_bool)
    #: Paged-attention kernels: ``"triton"`` (read K/V in place, :mod:`llminfer.backends.triton_attention`),
    #: ``"torch"`` (gather the context, then SDPA), ``"auto"`` (Triton on CUDA when triton imports, else torch).
    attention_backend: str = attrs.field(default="auto", validator=_one_of(ATTENTION_BACKENDS))
    #: Eager backend on CUDA with Triton attention: replay pure-decode steps as CUDA graphs captured for
    #: batch-size buckets (:mod:`llminfer.backends.cuda_graphs`). Ignored on CPU.
    cuda_graphs: bool = attrs.field(default=True, validator=_bool)
    #: On CPU (eager backend), keep the LM head's weight prepacked in oneDNN's blocked layout: fp32, and
    #: bf16/fp16 where native (one extra copy of the head); without oneDNN an fp32 head is stored column-major
    #: instead (no copy). See :mod:`llminfer.kernels.prepack`.
    cpu_prepack_lm_head: bool = attrs.field(default=True, validator=_bool)
    #: On CPU (eager and compiled backends), greedy rows that need no logits take an fp32 head's exact argmax
    #: through a bf16 copy of the head (one more half-size copy) where a probe at load measures it faster.
    #: See :mod:`llminfer.kernels.argmax_screen`.
    cpu_argmax_screen: bool = attrs.field(default=True, validator=_bool)
    #: On CPU (eager and compiled backends, x86-64 with AVX2 + FMA), run the fp32 decode attention and the
    #: linear products (fp32 layers and int8 weight-only layers, at any row count, so a row's bits do not
    #: depend on its batch; int8 with fp32 activations, or on AVX-512 VNNI with 14-bit integer activations) on
    #: llminfer's own kernels, built with the C++ compiler on
    #: first use (about 30 s, cached); where it cannot be built, torch's kernels. See
    #: :mod:`llminfer.kernels.build`.
    cpu_kernels: bool = attrs.field(default=True, validator=_bool)

    #: CPU threads of torch's (and llminfer's) kernels for this engine's steps. None: ``OMP_NUM_THREADS`` where
    #: set, else at most the physical cores, lowered while other processes keep cores busy (measured every
    #: 0.5 s, so a busy neighbour does not make the OpenMP team wait at every layer). See
    #: :mod:`llminfer.core.threads`.
    num_threads: int | None = attrs.field(default=None, validator=[_opt_int, _positive])

    tp_size: int = attrs.field(default=1, validator=[_int, _positive])
    pp_size: int = attrs.field(default=1, validator=[_int, _positive])

    def validate(self) -> EngineConfig:
        """Check cross-field rules; return self.

        Raises:
            ConfigError: naming the fields that conflict.
        """
        if not backend_spec(self.backend).multi_device and (self.tp_size > 1 or self.pp_size > 1):
            raise ConfigError(
                f"tp_size/pp_size > 1 need the {titles_with('multi_device')} backend (backend="
                f"{' or '.join(backends_with('multi_device'))}); the {self.backend.value} backend runs on one device"
            )
        if self.speculative_confidence_threshold > 1.0:
            raise ConfigError("speculative_confidence_threshold must be in [0, 1]")
        if self.speculative_method == "ngram" and self.assistant_model_name:
            raise ConfigError("speculative_method 'ngram' drafts without a model: drop assistant_model_name")
        if self.speculative_method == "draft_model" and not self.assistant_model_name:
            raise ConfigError("speculative_method 'draft_model' needs assistant_model_name")
        if self.speculative_prompt_lookup_min > self.speculative_prompt_lookup_max:
            raise ConfigError("speculative_prompt_lookup_min must be <= speculative_prompt_lookup_max")
        return self

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (enums as values, ``hf_token`` redacted) for artifacts and logs."""
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """Build a config from :meth:`to_dict` output.

        Raises:
            ConfigError: an unknown key or a bad value (the message names it).
        """
        return config_from_dict(data)


converter = cattrs.Converter(forbid_extra_keys=True)
for _enum_cls in (Backend, QuantMode):
    converter.register_unstructure_hook(_enum_cls, lambda member: member.value)
    converter.register_structure_hook(_enum_cls, lambda value, cls: _enum(cls)(value))


def config_to_dict(cfg: EngineConfig) -> dict[str, Any]:
    """Unstructure ``cfg`` to plain JSON types; the secret ``hf_token`` becomes ``"***"`` when set."""
    data = converter.unstructure(cfg)
    if data.get("hf_token"):
        data["hf_token"] = "***"
    return data


def config_from_dict(data: dict[str, Any]) -> EngineConfig:
    """Structure a dict into an :class:`EngineConfig`, turning cattrs' errors into one ConfigError."""
    try:
        return converter.structure(data, EngineConfig)
    except ConfigError:
        raise
    except cattrs.BaseValidationError as exc:
        details = "; ".join(str(e) for e in _leaf_errors(exc))
        raise ConfigError(f"invalid engine config: {details or exc}") from None


def _leaf_errors(exc: BaseException) -> list[BaseException]:
    subs = getattr(exc, "exceptions", None)  # an exception group (cattrs' backport on Python 3.10)
    if subs:
        out: list[BaseException] = []
        for sub in subs:
            out.extend(_leaf_errors(sub))
        return out
    return [exc]
