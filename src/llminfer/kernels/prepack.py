"""CPU weight prepacking: the LM head's weight held in oneDNN's blocked layout.

On CPU, a decode step of a small model is dominated by the LM head (``[V, d]`` read once per step;
151,646 x 512 = 155 MB in bf16, 310 MB in fp32 for the Qwen2 vocabulary). oneDNN's matmul on a weight
reordered once into its blocked layout runs that product much faster than ``torch.nn.functional.linear``
on the plain row-major weight. This is the same reorder that Inductor's weight-prepack pass inserts under
``torch.compile`` with freezing (``torch/_inductor/fx_passes/mkldnn_fusion.py``); here it is applied to one
eager module, so no compilation and no graph breaks are involved.

Where oneDNN is unavailable an fp32 head is stored column-major instead (:func:`transpose_linear_weight`: as
fast at one row, several times slower at 32). The speed-up: the README (CPU section) and
``bench/bench_cpu_kernels.py``.

The packed copy costs the head's bytes once more (the plain weight stays for tied input embeddings,
``state_dict`` and PEFT).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from llminfer.kernels.bf16_linear import bf16_linear
from llminfer.kernels.layers import adopt_linear
from llminfer.kernels.linear import skinny_linear

log = structlog.get_logger("llminfer.prepack")

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :class:`PrepackedLinear` can run here: a CPU with oneDNN, and for bf16 / fp16 native support
    for ``dtype``."""
    if device.type != "cpu" or dtype not in _PACKABLE_DTYPES:
        return False
    if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        return False
    if dtype is torch.float32:
        return True
    ops = torch.ops.mkldnn
    try:
        if dtype is torch.bfloat16:
            return bool(ops._is_mkldnn_bf16_supported())
        return bool(ops._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


#: fp32 products of at most this many rows run the LM head on :func:`~llminfer.kernels.linear.skinny_linear`
#: rather than the oneDNN-packed weight: up to 8 rows the kernel streams the weight from memory once, at
#: about the memory's bandwidth, while oneDNN's blocked GEMM wins from about 12 rows (measured on Zen 4 with
#: both kernel builds: the README's CPU section, ``bench/bench_cpu_kernels.py``).
FP32_HEAD_KERNEL_MAX_ROWS = 8


def head_kernel_rows(head: nn.Linear) -> int:
    """How many rows of a product the LM head ``head`` (plain weight ``[V, d]``) should run on llminfer's
    kernel before oneDNN's packed GEMM: :data:`FP32_HEAD_KERNEL_MAX_ROWS` (fp32, K % 8 == 0),
    :data:`~llminfer.kernels.bf16_linear.BF16_KERNEL_MAX_ROWS` (bf16 where
    :func:`~llminfer.kernels.build.bf16_kernel_available`, K % 32 == 0), else 0 (the kernel not loaded, or
    another dtype)."""
    from llminfer.kernels.bf16_linear import BF16_KERNEL_MAX_ROWS
    from llminfer.kernels.build import bf16_kernel_available, skinny_linear_available

    dtype, k = head.weight.dtype, head.in_features
    if not head.weight.is_contiguous():
        return 0
    if dtype == torch.float32 and k % 8 == 0 and skinny_linear_available():
        return FP32_HEAD_KERNEL_MAX_ROWS
    if dtype == torch.bfloat16 and k % 32 == 0 and bf16_kernel_available():
        return BF16_KERNEL_MAX_ROWS
    return 0


class PrepackedLinear(nn.Linear):
    """A drop-in for an ``nn.Linear`` whose weight is also kept reordered for oneDNN.

    It is an ``nn.Linear`` (so PEFT can wrap it like any linear layer), and the original ``weight`` (and
    ``bias``) stay registered under the same names, so tied embeddings and ``state_dict`` keys are
    unchanged. The packed copy (same bytes again, e.g. 155 MB for a 151k x 512 bf16 head) is rebuilt
    whenever the weight is modified in place (its version counter moves), so it never serves stale values.

    Args:
        linear: the module to wrap; its weight must be ``[out_features, in_features]`` in fp32, bf16 or fp16.

    Input ``[..., in_features]`` of the weight's dtype on CPU gives ``[..., out_features]`` of that dtype.
    Other inputs (another dtype or device, autograd on) fall back to ``F.linear``. Inputs of at most
    :attr:`kernel_rows` rows take llminfer's kernel on the plain weight instead
    (:func:`~llminfer.kernels.linear.skinny_linear` for fp32,
    :func:`~llminfer.kernels.bf16_linear.bf16_linear` for bf16; :func:`head_kernel_rows` says why and where).
    """

    #: Products of at most this many rows run on llminfer's kernel instead; 0 (the default) for none. Set
    #: from :func:`head_kernel_rows` by the backends that run llminfer's CPU kernels.
    kernel_rows = 0
    #: The head's :class:`~llminfer.kernels.argmax_screen.ArgmaxScreen` (an fp32 head, or a bf16 one with
    #: ``kernel_rows``), or None (set by :func:`~llminfer.kernels.argmax_screen.attach_argmax_screen`).
    argmax_screen = None
    #: Rows of the next products whose caller needs only each row's argmax (set around a step by
    #: :func:`argmax_only`); with a screen, those rows' logits are exact only at the candidates.
    argmax_only_rows: tuple[int, ...] = ()

    def __init__(self, linear: nn.Linear) -> None:
        adopt_linear(self, linear)
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
        screen = self.argmax_screen
        if self.argmax_only_rows and screen is not None and screen.takes(flat.shape[0]):
            return self._screened(flat, screen).reshape(*x.shape[:-1], self.out_features)
        return self._full(flat).reshape(*x.shape[:-1], self.out_features)

    def _screened(self, flat: torch.Tensor, screen: Any) -> torch.Tensor:
        rows = self.argmax_only_rows
        if len(rows) == flat.shape[0]:
            out = screen.logits(flat)
            return out if out is not None else self._full(flat)
        picked = torch.tensor(rows, dtype=torch.long)
        others = torch.tensor(sorted(set(range(flat.shape[0])) - set(rows)), dtype=torch.long)
        part = screen.logits(flat.index_select(0, picked))
        if part is None:
            return self._full(flat)
        # float32 for a bf16 head too: a screen value rounded to bf16 could climb to the best candidate's score
        out = torch.empty(flat.shape[0], self.out_features, dtype=part.dtype)
        out.index_copy_(0, picked, part)
        # the kernel the whole step would have taken, so these rows keep the bits they have without a screen
        out.index_copy_(0, others, self._full(flat.index_select(0, others), rows_in_step=flat.shape[0]).to(out.dtype))
        return out

    def _full(self, flat: torch.Tensor, rows_in_step: int | None = None) -> torch.Tensor:
        rows = flat.shape[0] if rows_in_step is None else rows_in_step
        if rows <= self.kernel_rows:  # a few rows read the plain weight faster on llminfer's kernel
            flat = flat.contiguous()
            return (bf16_linear(flat, self.weight, self.bias) if flat.dtype == torch.bfloat16
                    else skinny_linear(flat, self.weight, None, self.bias))
        return torch.ops.mkldnn._linear_pointwise(flat, self._packed_weight(), self.bias, "none", [], "")


@contextlib.contextmanager
def argmax_only(head: nn.Module | None, rows: Sequence[int]) -> Iterator[None]:
    """Within the block, the rows ``rows`` (indices into the head's flattened input) of ``head``'s products
    need only their argmax: a :class:`PrepackedLinear` with an argmax screen then scores only their
    candidates. A no-op for any other head or when ``rows`` is empty. Not re-entrant; one thread."""
    if not rows or getattr(head, "argmax_screen", None) is None:
        yield
        return
    head.argmax_only_rows = tuple(rows)  # type: ignore[union-attr]
    try:
        yield
    finally:
        head.argmax_only_rows = ()  # type: ignore[union-attr]


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
    """Swap ``model``'s output embedding (the LM head) for a :class:`PrepackedLinear` where oneDNN can run it
    (fp32; bf16 / fp16 where native); an fp32 head oneDNN cannot take is stored column-major instead
    (:func:`transpose_linear_weight`).

    Returns:
        True if the head was swapped or re-laid out; False (and the model untouched) if the head is not a plain
        ``nn.Linear`` (quantized, already wrapped) or the device/dtype gains nothing here.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return False
    fp32_cpu = head.weight.device.type == "cpu" and head.weight.dtype == torch.float32
    if not prepack_supported(head.weight.dtype, head.weight.device):
        return transpose_linear_weight(head) if fp32_cpu else False
    packed = PrepackedLinear(head)
    try:
        with torch.inference_mode():
            probe = torch.zeros(1, head.in_features, dtype=head.weight.dtype)
            packed(probe)
    except RuntimeError as exc:  # an oneDNN build without this kernel: keep the plain head
        log.warning("LM-head prepacking unavailable; using the plain weight", error=str(exc)[:200])
        return transpose_linear_weight(head) if fp32_cpu else False
    model.set_output_embeddings(packed)
    return True
