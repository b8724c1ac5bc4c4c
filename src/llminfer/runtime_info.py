"""What ``llminfer info`` says about a loaded :class:`~llminfer.runtime.Runtime`: environment, model,
weights, KV capacity, and the CPU kernel lines."""

from __future__ import annotations

from typing import Any

import torch

from llminfer.backends.registry import backend_spec, titles_with
from llminfer.config import EngineConfig, QuantMode
from llminfer.runtime import Runtime


def describe_runtime(rt: Runtime, cfg: EngineConfig) -> dict[str, Any]:
    """Environment, model and weight facts (``llminfer info``).

    ``weight_bytes`` is what the loaded weights occupy (bitsandbytes quantization state included),
    ``weight_bytes_unquantized`` what the same parameters take unquantized in ``dtype`` (from the config's
    parameter count), both in bytes; with ``--quant`` also the quantized linear layers' bytes against
    their bfloat16 bytes; ``kv_bytes`` the paged KV tensors' bytes, and on GPU ``kv_sizing_*`` the profiling
    run it was sized from (see :func:`llminfer.kv.sizing.gpu_kv_budget`). Without a loaded model (vLLM), the
    parameter count and bytes come from the config alone.
    """
    import platform

    import transformers

    from llminfer.models.quant import unquantized_weight_bytes, weight_footprint

    base_params, base_bytes = unquantized_weight_bytes(rt.model_config, rt.dtype, cfg.hf_trust_remote_code)
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda or "none",
        "device": str(rt.device),
        "backend": cfg.backend.value,
        "model": cfg.model_name or "llminfer/tiny-qwen2 (built-in)",
        "model_path": rt.model_path,
        "architecture": ",".join(getattr(rt.model_config, "architectures", None)
                                 or [type(rt.model).__name__ if rt.model is not None else "?"]),
        "parameters": base_params,
        "dtype": str(rt.dtype).replace("torch.", ""),
        "dtype_reason": rt.dtype_reason,
        "cpu_isa": _cpu_isa_line(),
        "quant": cfg.quant.mode.value,
        "weight_bytes_unquantized": base_bytes,
        "max_model_len": rt.max_model_len,
        "attention_backend": rt.attention_backend,
        "cpu_kernel": _cpu_kernel_line(rt, cfg),
    }
    if rt.gguf is not None:
        facts.update(_gguf_facts(rt, cfg))
    if rt.dtype_probe is not None:
        facts["dtype_probe"] = rt.dtype_probe
    if rt.model is None:
        facts.update({"tp_size": cfg.tp_size, "pp_size": cfg.pp_size, "prefix_cache": cfg.cache.enable_prefix_cache})
        return facts
    footprint = weight_footprint(rt.model)
    facts.update({"parameters": footprint["parameters"], "weight_bytes": footprint["weight_bytes"],
                  "weight_bytes_unquantized": base_bytes or footprint["weight_bytes"]})
    if cfg.quant.mode is not QuantMode.NONE:
        facts["quantized_linear_bytes"] = footprint["quantized_linear_bytes"]
        facts["quantized_linear_bf16_bytes"] = footprint["quantized_linear_bf16_bytes"]
    if rt.kv_cache is not None:
        facts["kv_bytes"] = rt.kv_cache.nbytes
    if rt.kv_sizing is not None:
        facts.update({f"kv_sizing_{k}": v for k, v in rt.kv_sizing.items()})
    return facts


def _gguf_facts(rt: Runtime, cfg: EngineConfig) -> dict[str, Any]:
    """``llminfer info``'s GGUF lines: the file, its type (and its tensors' types), and what llminfer made
    of it (the cached float32 folder, loaded in the engine's dtype, quantized again where ``--quant`` says)."""
    g = rt.gguf or {}
    tensors = ", ".join(f"{n} {t}" for t, n in g.get("tensor_types", {}).items())
    made = f"dequantized to {str(rt.dtype).replace('torch.', '')}"
    if cfg.quant.mode.weight_only:
        made += (f", then quantized again as {cfg.quant.mode.value}"
                 f"{f' (groups of {cfg.quant.int4_group_size})' if cfg.quant.mode is QuantMode.INT4_WO else ''}")
    elif cfg.quant.mode is not QuantMode.NONE:
        made += f", then quantized as {cfg.quant.mode.value} (bitsandbytes)"
    made += f"; float32 copy cached in {rt.model_path}"
    return {"gguf_file": g.get("file"), "gguf_type": f"{g.get('file_type')} ({g.get('architecture')}; tensors: {tensors})",
            "gguf_loaded_as": made}


def _cpu_kernel_line(rt: Runtime, cfg: EngineConfig) -> str:
    """``llminfer info``'s line on llminfer's CPU linear kernel: how many layers use it, or why none."""
    if rt.cpu_kernel_layers:
        from llminfer.kernels.bf16_linear import BF16_KERNEL_MAX_ROWS
        from llminfer.kernels.build import bf16_kernel_available, int8_activation_bits, vector_isa
        from llminfer.kernels.int8_group_linear import kernel_available as int8_group_kernel_available
        from llminfer.kernels.path_choice import quant_path_note, quant_paths

        # the op the model's layers run on, and how
        op, detail = "skinny_linear", "every row count"
        layers = rt.cpu_kernel_layers
        bits = int8_activation_bits()
        grouped = cfg.quant.int8_group_size and int8_group_kernel_available()
        int8_head_op = f"int8_group_linear (groups of {cfg.quant.int8_group_size})" if grouped else None
        # which int8-wo layers took the q8 path (groups other than 32 stay on the wide one)
        group_paths = {getattr(m, "kernel_path", None) for m in rt.model.modules()
                       if type(m).__name__ == "Int8GroupWeightOnlyLinear"} if rt.model is not None else set()
        head = rt.model.get_output_embeddings() if rt.model is not None else None
        if getattr(head, "kernel_path", None) == "q8":
            int8_head_op = "int8_group_linear_q8 (groups of 32)"
        if cfg.quant.mode is QuantMode.INT8_WO and grouped:
            op = "int8_group_linear_q8" if "q8" in group_paths else "int8_group_linear"
            detail += f"; int8 in groups of {cfg.quant.int8_group_size} on integer dot products, " + (
                f"activations as two 8-bit digits per 32 columns: the {quant_path_note('int8-group')}"
                + ("" if getattr(head, "kernel_path", "q8") == "q8" else
                   ", the LM head on the wide path (int8_group_linear, 14-bit activations)")
                if "q8" in group_paths
                else "14-bit activations" + (f" (the {quant_path_note('int8-group')})"
                                             if cfg.quant.int8_group_size == 32 else ""))
        elif cfg.quant.mode is QuantMode.INT8_WO:
            q8 = quant_paths()["int8"]["path"] == "q8"
            op = "int8_linear_q8" if q8 else "int8_linear"
            if not q8:
                detail += (f"; int8 on VNNI integer dot products, {bits}-bit activations" if bits
                           else "; int8 with float32 activations")
            detail += f"; int8 on the {quant_path_note('int8')}"
        elif cfg.quant.mode is QuantMode.INT4_WO:
            q8 = quant_paths()["int4"]["path"] == "q8"
            q8_op = "int4_group_linear_q8" if cfg.quant.int4_group_size == 32 else "int4_linear_q8"
            op = q8_op if q8 else ("int4_linear" if bits else "int8_linear")
            if not q8:
                detail += (f"; int4 on VNNI integer dot products, {bits}-bit activations" if bits
                           else "; int4 on torch's kernel (no AVX-512 VNNI here)")
            detail += f"; int4 on the {quant_path_note('int4')}"
            if type(head).__name__ == "Int6GroupWeightOnlyLinear":
                detail += "; the LM head in 6-bit groups on int6_group_linear_q8"
            elif type(head).__name__ == "Int4WeightOnlyLinear":
                detail += "; the LM head in int4 too"
            elif cfg.quant.quantize_lm_head and cfg.quant.int4_lm_head in ("int8", "int6"):
                head_op = int8_head_op or ("int8_linear_q8" if quant_paths()["int8"]["path"] == "q8"
                                           else "int8_linear")
                detail += f"; the LM head in int8 on {head_op}"
                layers -= int(getattr(head, "kernel_path", None) == "q8")  # counted with the layers it took
        elif rt.dtype == torch.bfloat16:
            op = "bf16_linear"
            detail = (f"bf16 on AVX-512 BF16 up to {BF16_KERNEL_MAX_ROWS} rows, torch's matmul beyond"
                      if bf16_kernel_available() else "bf16 products on torch: no AVX-512 BF16 path here")
        from llminfer.kernels.build import kernel_threads

        threads = "llminfer's worker threads" if kernel_threads() == "llminfer" else "OpenMP threads"
        return f"{op} on {layers} layers ({vector_isa()}, {detail}; {threads})"
    if rt.device.type != "cpu" or not backend_spec(cfg.backend).cpu_fast_path:
        return f"off (CPU {titles_with('cpu_fast_path')} backends only)"
    if not cfg.cpu_kernels:
        return "off (cpu_kernels=False)"
    from llminfer.kernels.build import unavailable_reason

    return f"off ({unavailable_reason() or 'no layer it takes'})"


def _cpu_isa_line() -> str:
    """``llminfer info``'s CPU line: torch's ISA level and the flags that decide ``dtype="auto"``."""
    from llminfer.models.loading import cpu_half_support

    support = cpu_half_support()
    return (f"{support['cpu_capability']}, native bf16 {'yes' if support['native']['bfloat16'] else 'no'}, "
            f"native fp16 {'yes' if support['native']['float16'] else 'no'} "
            f"(half-precision CPU flags: {', '.join(support['half_flags']) or 'none'})")
