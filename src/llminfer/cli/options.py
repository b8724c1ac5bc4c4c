"""The flags the ``llminfer`` commands share, and how they become engine settings.

Holds the ``Annotated[...]`` option types (one per flag, so each flag's name and help text is written
once), :func:`build_config` (engine flags → a validated :class:`EngineConfig`) and the small helpers every
command uses: :func:`split_csv`, :func:`check_log_level`, :func:`check_engine_flags` and :func:`load_engine`.
The engine flags are grouped, for the commands, in :class:`llminfer.cli.engine_options.EngineOptions`;
the sampling flags, and how they become ``SamplingParams``, are :mod:`llminfer.cli.sampling`'s.

Nothing here imports torch or transformers at module level: ``llminfer --help`` and every flag error must
answer at once, so every flag is checked before :func:`load_engine` pays for the model.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Annotated, Any

import typer

from llminfer.config import (
    ATTENTION_BACKENDS,
    Backend,
    CacheConfig,
    EngineConfig,
    QuantConfig,
    QuantMode,
    SchedulerConfig,
)

# ---------------------------------------------------------------------------- engine options
Model = Annotated[str | None, typer.Option("--model", "-m", help="Hugging Face model id, local folder or .gguf "
                                           "file (default: llminfer/smollm2-135m-instruct, a trained chat model "
                                           "fetched once, or $LLMINFER_DEFAULT_MODEL; bench and compare default "
                                           "to llminfer/tiny-qwen2, the random tiny model).")]
BackendOpt = Annotated[Backend, typer.Option("--backend", help="Backend that runs the model step.")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16.")]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate at most.")]
Seed = Annotated[int | None, typer.Option("--seed", help="Seed of this request's sampler.")]
BatchSize = Annotated[int, typer.Option("--max-batch-size", help="Most sequences in one step.")]
PageSize = Annotated[int, typer.Option("--page-size", help="KV block size in tokens.")]
NoPrefix = Annotated[bool, typer.Option("--no-prefix-cache", help="Switch automatic prefix caching off.")]
KVBytes = Annotated[int | None, typer.Option("--kv-cache-bytes", help="KV pool budget in bytes.")]
MaxLen = Annotated[int | None, typer.Option("--max-model-len", help="Context length in tokens.")]
Revision = Annotated[str | None, typer.Option("--revision", help="Model revision (branch, tag or commit).")]
HFToken = Annotated[str | None, typer.Option("--hf-token", help="Hugging Face token (never logged).")]
LocalOnly = Annotated[bool, typer.Option("--local-files-only", help="Never touch the network.")]
CacheDir = Annotated[str | None, typer.Option("--cache-dir", help="Hugging Face cache folder.")]
TrustRemote = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the hub.")]
TPSize = Annotated[int, typer.Option("--tp-size", help="Tensor-parallel size (vLLM backend only).")]
PPSize = Annotated[int, typer.Option("--pp-size", help="Pipeline-parallel size (vLLM backend only).")]
LogLevel = Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")]
AttnBackend = Annotated[str, typer.Option("--attention-backend", help="Paged-attention kernels: "
                                          f"{', '.join(ATTENTION_BACKENDS)} (auto: Triton on CUDA when "
                                          "installed; on a CPU llminfer's own kernel where it builds; else "
                                          "torch).")]
ChatOpt = Annotated[bool | None, typer.Option("--chat/--no-chat", show_default=False, help="Apply the model's "
                                              "chat template to the prompt (a user message). Default: on when "
                                              "the model has a chat template.")]
SystemOpt = Annotated[str | None, typer.Option("--system", help="System message put before the prompt "
                                               "(needs the chat template).")]
Assistant = Annotated[str | None, typer.Option("--assistant-model", help="Draft model for speculative "
                                               "decoding (same tokenizer as --model; 'builtin' allowed).")]
SpecK = Annotated[int, typer.Option("--spec-num-assistant-tokens", help="Draft tokens verified per step.")]
SpecC = Annotated[float, typer.Option("--spec-confidence-threshold",
                                      help="Stop drafting when the draft's top probability is below this.")]
SpecMethod = Annotated[str | None, typer.Option("--spec-method", help="Speculative drafts: draft_model (needs "
                                                "--assistant-model) or ngram (prompt lookup: copied from earlier "
                                                "in the prompt and output, no second model).")]
SpecLookupMax = Annotated[int, typer.Option("--spec-prompt-lookup-max", help="--spec-method ngram: longest "
                                            "suffix n-gram matched.")]
SpecLookupMin = Annotated[int, typer.Option("--spec-prompt-lookup-min", help="--spec-method ngram: shortest "
                                            "suffix n-gram matched.")]
# a str checked in build_config: typer's own Enum coercion words a bad value as
# "Value error, 'x' is not one of ..."
#: ``--quant``'s default: ``from-gguf`` where that keeps a GGUF model's own blocks on CPU, else ``none``
#: (:func:`auto_quant`).
QUANT_AUTO = "auto"
QuantOpt = Annotated[str, typer.Option("--quant", metavar=f"<{QUANT_AUTO}|{'|'.join(m.value for m in QuantMode)}>",
                                       help="Weight quantization: bitsandbytes (nf4, fp4, "
                                             "int8) or weight-only int8/int4 on llminfer's CPU kernels "
                                             "(int8-wo, int4-wo); from-gguf (a .gguf model: Q8_0 -> int8-wo, "
                                             "Q4_0/Q4_1 -> int4-wo); none. Default auto: from-gguf for a Q8_0/Q4_0/"
                                             "Q4_1 .gguf model (the built-in trained one included) on CPU with "
                                             "--dtype auto, the eager backend and no --adapter; none otherwise.")]
Int4Head = Annotated[str, typer.Option("--int4-lm-head", metavar="<int8|int6|int4>", help="With --quant int4-wo: "
                                        "the LM head's format: int8 (default, the fewest top-1 flips), int6 (the "
                                        "6-bit head of llama.cpp's Q4_0 files, 3/4 of int8's bytes; 94 % top-1 agreement on SmolLM2) or int4 (79 %: "
                                        "answers change).")]
AdapterOpt = Annotated[str | None, typer.Option("--adapter", help="LoRA adapter (PEFT folder or hub id) "
                                                "loaded on top of the model.")]
AdapterName = Annotated[str | None, typer.Option("--adapter-name", help="Name of the --adapter (default: "
                                                 "its folder's name).")]
CompileMode = Annotated[str, typer.Option("--compile-mode", help="Compiled backend: default, reduce-overhead "
                                          "or max-autotune.")]

# ---------------------------------------------------------------------------- benchmark options
ArtifactsDir = Annotated[str | None, typer.Option("--artifacts-dir", help="Folder for the JSON/CSV artifacts.")]
JsonOut = Annotated[str | None, typer.Option("--json-out", help="Explicit path of the JSON artifact.")]
CsvOut = Annotated[str | None, typer.Option("--csv-out", help="Explicit path of the CSV artifact.")]
PlotOpt = Annotated[str | None, typer.Option("--plot", help="Write a 2x2 dashboard PNG here.")]
PlotSuite = Annotated[str | None, typer.Option("--plot-suite-dir", help="Write the dashboard and one PNG per "
                                               "metric into this folder.")]
BatchSizes = Annotated[str, typer.Option("--batch-sizes", help="Comma-separated batch sizes, e.g. 1,2,4,8.")]
Runs = Annotated[int, typer.Option("--runs", help="Measured runs per batch size (after warm-up).")]
Warmup = Annotated[int, typer.Option("--warmup", help="Warm-up runs per batch size (not measured).")]
PromptLen = Annotated[int, typer.Option("--prompt-len", help="Tokens per synthetic prompt.")]
MaxBatchedTokens = Annotated[int | None, typer.Option(
    "--max-num-batched-tokens", min=1, help="Tokens computed in one engine step over all sequences, prefill "
    "chunks included (vLLM's flag; default: 2048). Smaller steps keep decode streams and new requests' "
    "time to first token short while long prompts arrive; larger ones prefill faster.")]
LongPrefill = Annotated[int, typer.Option(
    "--long-prefill-token-threshold", min=0, help="Most prompt tokens one request computes in one step "
    "(chunked prefill), so one long prompt cannot take a whole step; 0: only the step budget.")]
Threads = Annotated[int | None, typer.Option("--threads", min=1, help="CPU threads of the model step (default: "
                                             "OMP_NUM_THREADS if set, else the idle physical cores, measured).")]


# ---------------------------------------------------------------------------- flags -> settings
def build_config(
    *, model: str | None = None, backend: Backend = Backend.EAGER, dtype: str = "auto", device: str = "auto",
    max_batch_size: int = 16, page_size: int = 16, no_prefix_cache: bool = False,
    kv_cache_bytes: int | None = None, max_model_len: int | None = None, revision: str | None = None,
    hf_token: str | None = None, local_files_only: bool = False, cache_dir: str | None = None,
    trust_remote_code: bool = False, tp_size: int = 1, pp_size: int = 1, assistant_model: str | None = None,
    spec_num_assistant_tokens: int = 5, spec_confidence_threshold: float = 0.4,
    quant: QuantMode | str = QuantMode.NONE, int4_lm_head: str = "int8", attention_backend: str = "auto",
    threads: int | None = None, max_num_batched_tokens: int | None = None, long_prefill_token_threshold: int = 0,
    **extra: Any,
) -> EngineConfig:
    """Turn the engine flags (keyword arguments named like the command parameters; the defaults are the
    flags' defaults) into a validated :class:`EngineConfig`. ``extra`` goes to ``EngineConfig`` as is.

    Raises:
        typer.BadParameter: a value out of range, as ``--flag: message`` (the message names the config
            field; exit 2 like every other argument error).
    """
    from llminfer.errors import ConfigError

    if str(quant).lower() == QUANT_AUTO:
        quant = auto_quant(model, device=device, dtype=dtype, backend=backend)
    if not isinstance(quant, QuantMode) and str(quant).lower() not in {m.value for m in QuantMode}:
        raise typer.BadParameter(f"--quant: unknown mode {quant!r}; choose one of {QUANT_AUTO}, "
                                 f"{', '.join(m.value for m in QuantMode)}")
    try:
        return EngineConfig(
            model_name=model, backend=backend, dtype=dtype, device=device, max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            cache=CacheConfig(page_size_tokens=page_size, enable_prefix_cache=not no_prefix_cache,
                              kv_cache_memory_bytes=kv_cache_bytes),
            quant=QuantConfig(mode=quant, int4_lm_head=int4_lm_head),
            scheduler=SchedulerConfig(long_prefill_token_threshold=long_prefill_token_threshold,
                                      **({} if max_num_batched_tokens is None
                                         else {"max_num_batched_tokens": max_num_batched_tokens})),
            hf_revision=revision, hf_token=hf_token, hf_local_files_only=local_files_only, hf_cache_dir=cache_dir,
            hf_trust_remote_code=trust_remote_code, tp_size=tp_size, pp_size=pp_size,
            assistant_model_name=assistant_model, speculative_num_assistant_tokens=spec_num_assistant_tokens,
            speculative_confidence_threshold=spec_confidence_threshold, attention_backend=attention_backend,
            num_threads=threads, **extra,
        ).validate()
    except ConfigError as exc:
        message = str(exc)
        raise flag_error(message, CONFIG_FLAGS, subject=message.removeprefix("invalid engine config: ")) from None


def flag_error(message: str, flags: dict[str, str], subject: str | None = None) -> typer.BadParameter:
    """``message`` as a CLI argument error, prefixed ``--flag: `` when ``subject`` (default: ``message``)
    starts with one of ``flags``' keys (a setting's name in the Python API, e.g. ``max_batch_size``;
    ``flags`` maps it to its flag)."""
    subject = message if subject is None else subject
    flag = next((f for name, f in flags.items() if subject.startswith(name)), None)
    return typer.BadParameter(f"{flag}: {message}" if flag else message)


CONFIG_FLAGS: dict[str, str] = {
    "dtype": "--dtype", "device": "--device", "max_batch_size": "--max-batch-size",
    "page_size_tokens": "--page-size", "kv_cache_memory_bytes": "--kv-cache-bytes",
    "max_model_len": "--max-model-len", "tp_size": "--tp-size", "pp_size": "--pp-size",
    "attention_backend": "--attention-backend", "speculative_num_assistant_tokens": "--spec-num-assistant-tokens",
    "speculative_confidence_threshold": "--spec-confidence-threshold", "speculative_method": "--spec-method",
    "num_threads": "--threads", "max_num_batched_tokens": "--max-num-batched-tokens",
    "long_prefill_token_threshold": "--long-prefill-token-threshold",
    "speculative_prompt_lookup_max": "--spec-prompt-lookup-max",
    "speculative_prompt_lookup_min": "--spec-prompt-lookup-min", "int4_lm_head": "--int4-lm-head",
}
"""``EngineConfig`` field → the flag that sets it, for error messages."""


def auto_quant(model: str | None, *, device: str = "auto", dtype: str = "auto", backend: Backend = Backend.EAGER,
               adapter: str | None = None) -> QuantMode:
    """What ``--quant auto`` (the default) means for these flags: :attr:`QuantMode.FROM_GGUF` for a GGUF model
    whose file type a weight-only mode reproduces (Q8_0, Q4_0, Q4_1; the built-in trained model is Q4_1), on a
    CPU, with ``--dtype auto``, no ``--adapter`` and the eager backend (the figures below are the eager
    backend's; the compiled one is left as the user set it); :attr:`QuantMode.NONE` otherwise.

    Why: such a file's weights are already blocks of 8 or 4 bits. Run dense they are dequantized and, on a CPU
    with native bf16, rounded to bfloat16 with bfloat16 activations: on the built-in SmolLM2 that agreed with the
    float32 model on 96.9 % of next tokens and garbled greedy answers ("Hello! I'shine."), at 22.6 ms a token.
    ``from-gguf`` keeps the file's blocks with float32 activations: 100 %, 13.9 ms a token (2-vCPU Zen 4; the
    README's GGUF section has the figures). Reads the GGUF header of a ``.gguf`` path (a file it cannot read
    gives ``none``, and loading it then says what is wrong); the built-in model's file is not read or fetched
    here (:func:`llminfer.runtime.resolve_quant` does that at load).

    Raises:
        Nothing: every doubt gives :attr:`QuantMode.NONE`.
    """
    from llminfer.models.gguf import is_gguf_name, read_gguf_info, weight_only_mode
    from llminfer.models.trained import TRAINED_MODEL_NAME

    name = model or ""
    if (backend != Backend.EAGER or dtype != "auto" or adapter or not (name == TRAINED_MODEL_NAME or is_gguf_name(name))
            or device.startswith("cuda") or device.startswith("mps")):
        return QuantMode.NONE
    if device == "auto":
        import torch

        if torch.cuda.is_available():
            return QuantMode.NONE
    if name != TRAINED_MODEL_NAME:
        try:
            if weight_only_mode(read_gguf_info(name)) == QuantMode.NONE.value:
                return QuantMode.NONE
        except Exception:  # noqa: BLE001 - a K-quant file, or one that cannot be read: dense, as before
            return QuantMode.NONE
    return QuantMode.FROM_GGUF


def check_engine_flags(*, model: str | None = None, device: str = "auto", log_level: str = "warning",
                       adapter: str | None = None, adapter_name: str | None = None) -> None:
    """The engine flags that :class:`EngineConfig` cannot check without loading anything: ``--device``'s
    form, a ``--model`` or ``--adapter`` written as a path that is no folder, ``--log-level``,
    ``--adapter-name`` alone.

    Raises:
        typer.BadParameter: naming the flag.
    """
    check_log_level(log_level)
    if not _DEVICE.fullmatch(device):
        raise typer.BadParameter(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if model and (model.startswith(("/", "./", "../", "~")) or os.path.isfile(model)):
        path = os.path.expanduser(model)
        gguf = model.lower().endswith(".gguf")
        if not (os.path.isfile(path) if gguf else os.path.isdir(path)):
            what = ("is a file, not a model folder or .gguf file" if os.path.exists(path) and not gguf
                    else "is not a file" if os.path.exists(path) else "does not exist")
            raise typer.BadParameter(f"--model: {model!r} {what}")
    if adapter_name and not adapter:
        raise typer.BadParameter("--adapter-name needs --adapter")
    if adapter and adapter.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(adapter)):
        # before the model loads, not after (a hub id is looked up when the adapter loads)
        raise typer.BadParameter(f"--adapter: {adapter!r} is not a folder")


_DEVICE = re.compile(r"auto|(cpu|cuda|mps|xpu)(:\d+)?")


def split_csv(value: str | None) -> list[str]:
    """``"a,,b"`` → ``["a", "b"]``; ``None`` or ``""`` → ``[]``."""
    return [s for s in (value or "").split(",") if s]


def check_log_level(level: str) -> None:
    """Raises typer.BadParameter unless ``level`` is debug, info, warning or error (any case)."""
    if level.lower() not in ("debug", "info", "warning", "error"):
        raise typer.BadParameter(f"--log-level must be debug, info, warning or error, got {level!r}")


def setup_output(log_level: str) -> None:
    """The CLI's logging (stderr at ``--log-level``) and status lines (on when stderr is a terminal).

    Raises typer.BadParameter for a bad ``--log-level``.
    """
    from llminfer.logging import configure_logging, enable_status_lines

    check_log_level(log_level)
    configure_logging(log_level)
    enable_status_lines(sys.stderr.isatty())


def load_engine(cfg: EngineConfig, log_level: str, adapter: str | None = None, adapter_name: str | None = None):
    """Configure logging, load an :class:`InferenceEngine` for ``cfg`` and the ``--adapter``, if any, with a
    status line on stderr while it loads (when stderr is a terminal).

    Raises typer.BadParameter for a bad ``--log-level`` or ``--adapter-name`` without ``--adapter``, and
    whatever loading the model or the adapter raises.
    """
    check_engine_flags(log_level=log_level, adapter=adapter, adapter_name=adapter_name)
    setup_output(log_level)
    from llminfer.engine import InferenceEngine
    from llminfer.logging import status

    with status(f"loading {cfg.model_name or 'the built-in model'} ..."):
        engine = InferenceEngine(cfg).load()
        if adapter:
            engine.load_adapter(adapter, adapter_name)
    return engine
