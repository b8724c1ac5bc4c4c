"""Weight quantization through bitsandbytes or torch's CPU weight-only kernels, and weight-footprint accounting.

``QuantConfig(mode=NF4 | FP4)`` loads every linear layer but the LM head as a bitsandbytes ``Linear4bit``
(4-bit blocks of 64 weights with one absmax each, ``double_quant`` quantizing those absmax values again),
computing in ``compute_dtype``; ``INT8`` loads ``Linear8bitLt`` (LLM.int8(): int8 rows with a float32
scale each). Embeddings, norms and the LM head stay in the model dtype, as transformers does.

``INT8_WO`` / ``INT4_WO`` replace the linear layers after loading by the weight-only modules of
:mod:`llminfer.models.weight_only` (CPU only; the LM head too unless ``quantize_lm_head`` is off), see
:func:`apply_weight_only`.

With bitsandbytes >= 0.45 all three modes run on CPU as well as CUDA (checked at load by a tiny
quantize/dequantize round trip on the target device, so an unsupported combination fails at once with one
:class:`~llminfer.errors.BackendUnavailableError` line instead of deep inside the first step).
"""

from __future__ import annotations

import logging
from typing import Any

import structlog
import torch

from llminfer.config import QuantConfig, QuantMode
from llminfer.errors import BackendUnavailableError, ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

INSTALL_HINT = "pip install 'llminfer[quant]' (bitsandbytes)"


def require_bitsandbytes() -> Any:
    """Import bitsandbytes.

    Returns:
        The ``bitsandbytes`` module.

    Raises:
        BackendUnavailableError: bitsandbytes is not installed or does not import here.
    """
    # On an AVX512-BF16 CPU, bitsandbytes' import asks the Hugging Face kernel hub for a faster 4-bit GEMM and,
    # offline, logs a warning that tells the user to set trust_remote_code (llminfer never needs it:
    # bitsandbytes then runs its own kernel). Only that logger's warnings are muted; its errors still show.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except Exception as exc:  # noqa: BLE001 - an ImportError, or a broken native library
        raise BackendUnavailableError(f"--quant needs bitsandbytes: {INSTALL_HINT} ({type(exc).__name__}: "
                                      f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''})") from None
    return bitsandbytes


def check_mode_supported(mode: QuantMode, device: torch.device) -> None:
    """Run a tiny quantize/dequantize of ``mode`` on ``device`` so an unsupported mode fails at load.

    Raises:
        BackendUnavailableError: bitsandbytes is missing or cannot run ``mode`` on ``device`` (one line).
    """
    bnb = require_bitsandbytes()
    w = torch.randn(64, 64, device=device, dtype=torch.float16 if device.type == "cuda" else torch.float32)
    try:
        if mode is QuantMode.INT8:
            x = torch.randn(2, 64, device=device, dtype=w.dtype)
            lin = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)
            lin.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
            lin = lin.to(device)
            with torch.inference_mode():
                lin(x)
        else:
            q, state = bnb.functional.quantize_4bit(w, quant_type=mode.value)
            bnb.functional.dequantize_4bit(q, state)
    except Exception as exc:  # noqa: BLE001 - whatever bitsandbytes raises, one clear line
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise BackendUnavailableError(
            f"bitsandbytes {getattr(bnb, '__version__', '?')} cannot run {mode.value} quantization on "
            f"{device.type}: {first}") from None


def check_weight_only_supported(quant: QuantConfig, device: torch.device) -> None:
    """Fail at load, in one line, where the weight-only modes cannot run.

    Raises:
        ConfigError: ``device`` is not the CPU (the kernels are torch's CPU ones).
        BackendUnavailableError: this torch build lacks the kernels.
    """
    from llminfer.models.weight_only import check_kernels_available

    if device.type != "cpu":
        raise ConfigError(f"quant.mode {quant.mode.value} runs on CPU only (torch's CPU weight-only kernels); "
                          f"on {device.type} use --quant nf4|int8 (bitsandbytes) or --device cpu")
    problem = check_kernels_available()
    if problem:
        raise BackendUnavailableError(f"quant.mode {quant.mode.value} needs torch's CPU weight-only kernels "
                                      f"(torch {torch.__version__}): {problem}")


def apply_weight_only(model: torch.nn.Module, quant: QuantConfig) -> dict[str, Any]:
    """Quantize ``model``'s linear layers in place for a weight-only ``quant.mode`` (a no-op otherwise).

    Returns:
        :func:`llminfer.models.weight_only.quantize_model`'s report (empty for other modes).

    Raises:
        ConfigError, BackendUnavailableError: as :func:`check_weight_only_supported`.
    """
    if not quant.mode.weight_only:
        return {}
    from llminfer.models.weight_only import quantize_model

    device = next(model.parameters()).device
    check_weight_only_supported(quant, device)
    report = quantize_model(model, quant.mode.value, group_size=quant.int4_group_size,
                            compute_dtype=_DTYPES[quant.compute_dtype], quantize_lm_head=quant.quantize_lm_head,
                            int4_lm_head=quant.int4_lm_head, int8_group_size=quant.int8_group_size)
    int4 = quant.mode is QuantMode.INT4_WO
    fmt = ({"int4_group_size": quant.int4_group_size,
            "lm_head": quant.int4_lm_head if quant.quantize_lm_head else "not quantized"} if int4
           else {"int8_format": report.get("int8_format")})
    structlog.get_logger("llminfer.quant").info(
        "weight-only quantization", mode=quant.mode.value, quantized_layers=len(report["quantized"]), **fmt,
        skipped={k: v for k, v in report["skipped"].items()} or None)
    return report


def bnb_config(quant: QuantConfig, device: torch.device) -> Any:
    """The transformers ``BitsAndBytesConfig`` for ``quant`` (None when ``mode`` is NONE or weight-only:
    those are applied after loading, by :func:`apply_weight_only`, and only checked here).

    Raises:
        BackendUnavailableError: bitsandbytes is missing or cannot run the mode on ``device``.
        ConfigError: a weight-only mode on a device other than the CPU.
    """
    if quant.mode is QuantMode.NONE:
        return None
    if quant.mode.weight_only:
        check_weight_only_supported(quant, device)
        return None
    check_mode_supported(quant.mode, device)
    from transformers import BitsAndBytesConfig

    if quant.mode is QuantMode.INT8:
        _quiet_int8_cast_warning()
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant.mode.value,
        bnb_4bit_use_double_quant=quant.double_quant,
        bnb_4bit_compute_dtype=_DTYPES[quant.compute_dtype],
    )


class _DropInt8CastWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast" not in record.getMessage()


def _quiet_int8_cast_warning() -> None:
    """bitsandbytes logs "MatMul8bitLt: inputs will be cast ... to float16" on every int8 matmul with
    non-fp16 inputs (every step on CPU); keep that one message out of the logs (idempotent)."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropInt8CastWarning) for f in logger.filters):
        logger.addFilter(_DropInt8CastWarning())


# ----------------------------------------------------------------------------------------------- footprint
def _tensor_bytes(tensors: list[torch.Tensor]) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key in seen:
            continue
        seen.add(key)
        total += key[1]
    return total


def _quant_state_tensors(param: torch.Tensor) -> list[torch.Tensor]:
    """Tensors a bitsandbytes parameter carries besides its data (4-bit quant state, int8 row scales)."""
    out: list[torch.Tensor] = []
    qs = getattr(param, "quant_state", None)
    if qs is not None:
        out += [getattr(qs, "absmax", None), getattr(qs, "code", None), getattr(qs, "offset", None)]
        st2 = getattr(qs, "state2", None)
        if st2 is not None:
            out += [getattr(st2, "absmax", None), getattr(st2, "code", None)]
    scb = getattr(param, "SCB", None)
    if isinstance(scb, torch.Tensor):
        out.append(scb)
    return [t for t in out if isinstance(t, torch.Tensor)]


def _logical_numel(param: torch.Tensor) -> int:
    qs = getattr(param, "quant_state", None)
    shape = getattr(qs, "shape", None) if qs is not None else None
    return int(torch.Size(shape).numel()) if shape is not None else param.numel()


def weight_footprint(model: torch.nn.Module) -> dict[str, int]:
    """What the loaded weights occupy.

    Returns:
        ``weight_bytes``: bytes of every parameter and buffer plus bitsandbytes quantization state
        (shared tensors counted once; weight-only layers' int8/int4 buffers and scales included; a quantized
        tied LM head adds its copy); ``parameters``: logical parameter count (a packed 4-bit weight
        counts its unpacked elements); ``quantized_linear_bytes``: bytes of the quantized linear layers'
        weights, quantization state included (biases excluded); ``quantized_linear_bf16_bytes``: what those
        weights take in bfloat16 (2 bytes per logical element). Both linear figures are 0 for an unquantized model.
    """
    from llminfer.models.weight_only import WEIGHT_ONLY_TYPES

    params = list(model.parameters())
    extra: list[torch.Tensor] = [t for p in params for t in _quant_state_tensors(p)]
    total = _tensor_bytes(params + list(model.buffers()) + extra)
    lin_bytes = lin_bf16 = wo_params = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, WEIGHT_ONLY_TYPES):
            lin_bytes += module.quantized_bytes()
            lin_bf16 += 2 * module.in_features * module.out_features
            # A quantized tied LM head is a copy of the input embedding: its parameters are counted there.
            wo_params += 0 if module.tied_to_input_embedding else module.in_features * module.out_features
        elif isinstance(w, torch.Tensor) and (hasattr(w, "quant_state") or hasattr(w, "SCB")):
            lin_bytes += _tensor_bytes([w, *_quant_state_tensors(w)])
            lin_bf16 += 2 * _logical_numel(w)
    return {
        "weight_bytes": total,
        "parameters": sum(_logical_numel(p) for p in params) + wo_params,
        "quantized_linear_bytes": lin_bytes,
        "quantized_linear_bf16_bytes": lin_bf16,
    }


def unquantized_weight_bytes(model_config: Any, dtype: torch.dtype, trust_remote_code: bool = False) -> tuple[int, int]:
    """Parameters and bytes of the model unquantized in ``dtype``, from its config alone (built on the
    meta device: no memory, no weights read).

    Returns:
        ``(parameters, bytes)``; ``(0, 0)`` when the architecture cannot be built from the config.
    """
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - the figure is informative only
        return 0, 0
    n = sum(p.numel() for p in meta.parameters())
    return n, n * torch.empty((), dtype=dtype).element_size()
