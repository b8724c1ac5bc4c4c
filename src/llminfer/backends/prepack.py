"""CPU weight prepacking: the LM head's weight held in oneDNN's blocked layout.

On CPU, a decode step of a small model is dominated by the LM head (``[V, d]`` read once per step;
151,646 x 512 bf16 = 155 MB for the Qwen2 vocabulary). oneDNN's matmul on a weight reordered once into
its blocked layout runs that product much faster than ``torch.nn.functional.linear`` on the plain
row-major weight, which reorders on the fly (measured on a 2-core AVX512-BF16 machine: 21.3 -> 13.6 ms at
32 rows, 11.7 -> 6.5 ms at 1 row). This is the same reorder that Inductor's weight-prepack pass inserts
under ``torch.compile`` with freezing (``torch/_inductor/fx_passes/mkldnn_fusion.py``); here it is applied
to one eager module, so no compilation and no graph breaks are involved.

In float32 the head is instead stored column-major: the ``[V, d]`` weight becomes the transposed view of a
contiguous ``[d, V]`` tensor (same bytes, no copy kept), so ``F.linear`` multiplies by a contiguous
``[d, V]`` matrix. MKL's fp32 GEMV/GEMM runs that layout much faster for a few rows (measured on the 2-core
AVX2 machine, 151,000 x 512: 107 -> 31 ms at 1 row, 616 -> 520 ms at 32 rows, loaded machine). A tied input
embedding shares the parameter; its lookups then read strided rows: 32 tokens 0.09 -> 0.23 ms, a 2048-token
prefill 19 -> 55 ms, next to that prefill's seconds of matmuls.
"""

from __future__ import annotations

import structlog
import torch
import torch.nn.functional as F
from torch import nn

log = structlog.get_logger("llminfer.prepack")

_PACKABLE_DTYPES = (torch.bfloat16, torch.float16)


def prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :class:`PrepackedLinear` can run here: a CPU with oneDNN and native support for ``dtype``."""
    if device.type != "cpu" or dtype not in _PACKABLE_DTYPES:
        return False
    if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        return False
    ops = torch.ops.mkldnn
    try:
        if dtype is torch.bfloat16:
            return bool(ops._is_mkldnn_bf16_supported())
        return bool(ops._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


class PrepackedLinear(nn.Linear):
    """A drop-in for an ``nn.Linear`` whose weight is also kept reordered for oneDNN.

    It is an ``nn.Linear`` (so PEFT can wrap it like any linear layer), and the original ``weight`` (and
    ``bias``) stay registered under the same names, so tied embeddings and ``state_dict`` keys are
    unchanged. The packed copy (same bytes again, e.g. 155 MB for a 151k x 512 bf16 head) is rebuilt
    whenever the weight is modified in place (its version counter moves), so it never serves stale values.

    Args:
        linear: the module to wrap; its weight must be ``[out_features, in_features]`` in bf16 or fp16.

    Input ``[..., in_features]`` of the weight's dtype on CPU gives ``[..., out_features]`` of that dtype.
    Other inputs (another dtype or device, autograd on) fall back to ``F.linear``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: that would allocate a second weight
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self._packed: torch.Tensor | None = None
        self._packed_version = -1

    def _packed_weight(self) -> torch.Tensor:
        version = self.weight._version
        if self._packed is None or version != self._packed_version:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
            self._packed_version = version
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type != "cpu" or x.dtype != self.weight.dtype or self.weight.device.type != "cpu"
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed_weight(), self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def transpose_linear_weight(linear: nn.Linear) -> bool:
    """Store ``linear.weight`` (``[out, in]``) as the transposed view of a contiguous ``[in, out]`` tensor,
    in place: the same ``Parameter`` object (ties and ``state_dict`` keys unchanged), the same values.

    Returns:
        True if the layout changed; False if it already was column-major.
    """
    weight = linear.weight
    if weight.dim() != 2 or weight.t().is_contiguous():
        return False
    with torch.no_grad():
        weight.data = weight.data.t().contiguous().t()
    return True


def prepack_lm_head(model: nn.Module) -> bool:
    """Swap ``model``'s output embedding (the LM head) for a :class:`PrepackedLinear` when that helps here
    (bf16/fp16), or store its fp32 weight column-major (:func:`transpose_linear_weight`).

    Returns:
        True if the head was swapped or re-laid out; False (and the model untouched) if the head is not a plain
        ``nn.Linear`` (quantized, already wrapped) or the device/dtype cannot use oneDNN's packed matmul.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return False
    if head.weight.device.type == "cpu" and head.weight.dtype == torch.float32:
        return transpose_linear_weight(head)
    if not prepack_supported(head.weight.dtype, head.weight.device):
        return False
    packed = PrepackedLinear(head)
    try:
        with torch.inference_mode():
            probe = torch.zeros(1, head.in_features, dtype=head.weight.dtype)
            packed(probe)
    except RuntimeError as exc:  # an oneDNN build without this kernel: keep the plain head
        log.warning("LM-head prepacking unavailable; using the plain weight", error=str(exc)[:200])
        return False
    model.set_output_embeddings(packed)
    return True
