"""A loaded model's linear layers put on llminfer's CPU kernels (:func:`enable_cpu_kernels`): plain fp32 / bf16
layers swapped for :class:`~llminfer.kernels.layers.SkinnyLinear`, weight-only quantized layers switched to the
kernel path :func:`~llminfer.kernels.path_choice.quant_paths` chose."""

from __future__ import annotations

import torch
from torch import nn

from llminfer.kernels import build
from llminfer.kernels.layers import KernelRMSNorm, SkinnyLinear
from llminfer.kernels.path_choice import quant_paths
from llminfer.models.fused_projections import fuse_projections
from llminfer.models.weight_only import Int4WeightOnlyLinear, Int8GroupWeightOnlyLinear, Int8WeightOnlyLinear

#: transformers' RMSNorm classes that compute ``weight * (x * rsqrt(mean(x ** 2) + eps))`` in float32, the
#: operations of :class:`~llminfer.kernels.layers.KernelRMSNorm` (Gemma's ``1 + weight`` form is not one).
RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"})


def _swap_rms_norms(model: nn.Module) -> None:
    norms = [(name, m) for name, m in model.named_modules()
             if type(m).__name__ in RMS_NORMS and isinstance(getattr(m, "weight", None), torch.Tensor)
             and m.weight.dtype == torch.float32 and m.weight.dim() == 1 and m.weight.device.type == "cpu"
             and isinstance(getattr(m, "variance_epsilon", None), float)]
    for name, norm in norms:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, KernelRMSNorm(norm))


def enable_cpu_kernels(model: nn.Module, include_head: bool = False) -> int:
    """Put ``model``'s linear products on llminfer's kernels, in place, where they build and load here.

    Every fp32 CPU ``nn.Linear`` (modules of exactly that type with ``in_features % 8 == 0``) and, where
    :func:`~llminfer.kernels.build.bf16_kernel_available`, every bf16 one with ``in_features % 32 == 0``
    becomes a :class:`~llminfer.kernels.layers.SkinnyLinear`; the LM head only with ``include_head`` (the
    eager backend puts it on oneDNN with :func:`llminfer.kernels.prepack.prepack_lm_head`, whose lazily packed
    weight does not trace under ``torch.compile``, so the compiled backend takes the kernel for it). Every
    :class:`~llminfer.models.weight_only.Int8WeightOnlyLinear` (the head included) takes the kernel for any
    row count (``int8_linear_q8`` or ``int8_linear``, as :func:`~llminfer.kernels.path_choice.quant_paths`
    chose), and so does every :class:`~llminfer.models.weight_only.Int4WeightOnlyLinear` (``int4_linear_q8``,
    or ``int4_linear`` where the kernel has its VNNI path and that path was chosen; the codes are re-laid
    out in place). :class:`~llminfer.models.weight_only.Int8GroupWeightOnlyLinear` layers run on
    ``int8_group_linear`` by themselves, or, where the ``int8-group`` path chosen is ``q8``, are re-laid out
    for ``int8_group_linear_q8`` (groups of 32; :meth:`~llminfer.models.weight_only.Int8GroupWeightOnlyLinear.use_q8_path`);
    they are counted here. Every float32 Llama-family RMSNorm
    (:data:`RMS_NORMS`) becomes a :class:`~llminfer.kernels.layers.KernelRMSNorm` (not counted).

    Args:
        model: the loaded model (modules swapped in place).
        include_head: also put an fp32 or bf16 ``nn.Linear`` LM head on the kernel (the compiled backend).

    Returns:
        How many layers now use the kernel (0 where it is unavailable: see
        :func:`~llminfer.kernels.build.unavailable_reason`).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plain = [(name, m) for name, m in model.named_modules()
             if type(m) is nn.Linear and (include_head or m is not head) and m.weight.device.type == "cpu"]
    fp32 = [(n, m) for n, m in plain if m.weight.dtype == torch.float32 and m.in_features % 8 == 0]
    bf16 = [(n, m) for n, m in plain if m.weight.dtype == torch.bfloat16 and m.in_features % 32 == 0]
    int8 = [m for m in model.modules() if isinstance(m, Int8WeightOnlyLinear) and m.weight.device.type == "cpu"]
    int4 = [m for m in model.modules() if isinstance(m, Int4WeightOnlyLinear) and m.weight.device.type == "cpu"]
    grouped = [m for m in model.modules() if isinstance(m, Int8GroupWeightOnlyLinear) and m.weight.device.type == "cpu"]
    if not (fp32 or bf16 or int8 or int4 or grouped) or not build.skinny_linear_available():
        return 0
    _swap_rms_norms(model)
    paths = (quant_paths() if (int8 or int4 or grouped)
             else {kind: {"path": "wide"} for kind in ("int8", "int8-group", "int4")})
    swapped = fp32 + (bf16 if build.bf16_kernel_available() else [])
    for name, linear in swapped:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, SkinnyLinear(linear))
    for layer in int8:
        layer.use_cpu_kernel = True
        layer.kernel_path = "q8" if paths["int8"]["path"] == "q8" and layer.in_features % 32 == 0 else "wide"
        layer._kernel_scales = layer.scales.float().contiguous()  # now, not inside a torch.compile trace
    group_path = paths["int8-group"]
    if group_path["path"] == "q8":  # the LM head too: at one row it reads its codes a little slower than on the
        for layer in grouped:       # wide path, at 8 and 32 rows 1.7 and 2.2 times faster (README, CPU kernels)
            layer.use_q8_path()
    int4_path = paths["int4"]["path"]
    if int4_path == "wide":  # int4_linear needs the VNNI integer path (and K <= 32768); else torch's kernel stays
        int4 = [m for m in int4 if m.in_features <= 32768] if build.int8_activation_bits() is not None else []
    for layer in int4:
        layer.use_llminfer_kernel(int4_path)
    fuse_projections(model)  # q/k/v and gate/up of the q8 weight-only layers, one product each
    return len(swapped) + len(int8) + len(int4) + len(grouped)
