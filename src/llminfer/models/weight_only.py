"""Weight-only int8 / int4 quantization for CPU decode, on torch's own CPU kernels (no extra dependency).

Batch-1 decode on CPU is bound by the bytes of weights read per step, so storing the linear layers' weights
in 8 or 4 bits and dequantizing them inside the matmul cuts the step time roughly with the bytes. The
activations stay in floating point ("weight-only"), which keeps the accuracy close to the unquantized model.

- ``int8-wo``: by default group-wise, 8-bit codes with a scale and a minimum per group of 32 input columns
  (:class:`Int8GroupWeightOnlyLinear`, :mod:`llminfer.kernels.int8_group_linear`); with ``int8_group_size=0``
  symmetric per output channel, ``W[n, k] ≈ q[n, k] * max_k |W[n, k]| / 127`` (:class:`Int8WeightOnlyLinear`,
  torch's ``_weight_int8pack_mm``, the kernel gpt-fast's int8 mode uses on CPU, or llminfer's kernels).
- ``int4-wo`` (:class:`Int4WeightOnlyLinear`): asymmetric group-wise uint4 along the input dimension,
  ``W[n, k] ≈ (q[n, k] - 8) * scale[n, g] + zero[n, g]`` for ``g = k // group_size``, ``scale = (max - min) /
  15`` and ``zero = min + 8 * scale`` over the group (torch's tinygemm layout), on torch's
  ``_weight_int4pack_mm_for_cpu``, or re-laid out for llminfer's kernels
  (:meth:`Int4WeightOnlyLinear.use_llminfer_kernel`).

Which of llminfer's kernel paths a layer takes is :func:`llminfer.kernels.path_choice.quant_paths`'s measured
choice, applied by :func:`llminfer.models.kernel_swap.enable_cpu_kernels`.

Activation dtype: torch vectorizes both kernels on x86 (AVX2 and AVX-512) for **bfloat16** activations
only; float32 and float16 activations take a scalar loop there that is several times slower than the fp32
matmul it replaces. The layers therefore cast their input to ``compute_dtype`` (default bfloat16,
:attr:`llminfer.config.QuantConfig.compute_dtype`) for the kernel and the result back to the input's dtype;
the rest of the model (attention, norms, the KV cache) keeps the model dtype. ``compute_dtype="float32"``
gives products exact up to fp32 rounding, at the scalar kernel's speed.

Shape rules of the kernels (layers that do not meet them stay unquantized, listed in the report):
int8 needs ``in_features % 8 == 0`` (the AVX2 kernel reads 8 columns at a time and has no tail);
int4 needs ``in_features % group_size == 0`` and pads ``out_features`` up to a multiple of 16.

The quantized modules subclass ``nn.Linear`` (without allocating a float weight) so PEFT wraps them with
LoRA like any linear layer: the LoRA product runs in floating point on top of the quantized base
(QLoRA-style), the adapters stay in the model dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llminfer.kernels import int8_group_linear as int8_group
from llminfer.kernels.int4_linear import int4_linear, pack_int4_codes, unpack_int4_codes
from llminfer.kernels.linear import int8_linear
from llminfer.kernels.q8_linear import (
    int4_linear_q8,
    int8_linear_q8,
    pack_int4_codes_q8,
    unpack_int4_codes_q8,
)
from llminfer.models.quantizers import (  # noqa: F401 - re-exported: the layers' quantizers
    INT4_GROUP_SIZES,
    dequantize_int4,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
)
from llminfer.models.weight_only_base import WeightOnlyLinear as _WeightOnlyLinear
from llminfer.models.weight_only_int6 import Int6GroupWeightOnlyLinear

_INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
_INT8_K_MULTIPLE = 8


# --------------------------------------------------------------------------------------------- modules
class Int8WeightOnlyLinear(_WeightOnlyLinear):
    """``nn.Linear`` replacement with an int8 per-output-channel weight.

    Buffers: ``weight`` int8 ``[out_features, in_features]``; ``scales`` ``[out_features]`` in
    ``compute_dtype``. Input ``[..., in_features]`` (any float dtype) gives ``[..., out_features]`` of the
    input's dtype: ``x @ (weight * scales[:, None]).T + bias`` with ``x`` rounded to ``compute_dtype`` and
    the result rounded to ``compute_dtype`` before the cast back (fp32 accumulation inside the kernel).

    Raises:
        ValueError: ``in_features`` is not a multiple of 8.
    """

    mode = "int8-wo"

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        if linear.in_features % _INT8_K_MULTIPLE:
            raise ValueError(f"int8 weight-only needs in_features % {_INT8_K_MULTIPLE} == 0, "
                             f"got {linear.in_features}")
        super().__init__(linear, compute_dtype)
        q, scales = quantize_int8_per_channel(linear.weight)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales.to(compute_dtype))

    #: Set by :func:`llminfer.models.kernel_swap.enable_cpu_kernels`: CPU inputs of any row count run on
    #: llminfer's kernel (:func:`~llminfer.kernels.linear.int8_linear`: float32 activations, or on the
    #: AVX-512 VNNI build activations rounded to 14 bits per row and exact integer sums), or, where
    #: ``kernel_path`` is ``"q8"``, :func:`~llminfer.kernels.q8_linear.int8_linear_q8` (activations rounded
    #: to 8 bits per block of 32 columns, as llama.cpp's Q8_0). ``compute_dtype`` is not applied: the first two
    #: are more exact than bf16 activations, the third about as exact, and all faster than torch's kernel; one
    #: kernel for prefill and decode keeps a row's result independent of how the step was packed.
    use_cpu_kernel = False
    #: ``"q8"`` or ``"wide"``: which of the kernel's int8 products this layer runs (set with use_cpu_kernel,
    #: from :func:`llminfer.kernels.path_choice.quant_paths`).
    kernel_path = "wide"
    _kernel_scales: torch.Tensor | None = None  # ``scales`` in float32 for that kernel (enable_cpu_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_cpu_kernel or x.device.type != "cpu":
            return super().forward(x)
        rows = x.numel() // self.in_features
        scales = self._kernel_scales
        if scales is None or scales.dtype != torch.float32:  # made by enable_cpu_kernels (before any trace)
            scales = self._kernel_scales = self.scales.float().contiguous()
        bias = None if self.bias is None else self.bias.float()
        flat = x.reshape(rows, self.in_features).float().contiguous()
        product = int8_linear_q8 if self.kernel_path == "q8" else int8_linear
        out = product(flat, self.weight, scales, bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 ``[out_features, in_features]`` weight the layer computes with."""
        return self.weight.float() * self.scales.float()[:, None]


class Int8GroupWeightOnlyLinear(_WeightOnlyLinear):
    """``nn.Linear`` replacement with int8-wo's group-wise weight (:mod:`llminfer.kernels.int8_group_linear`).

    Buffers: ``weight``, the codes, uint8 ``[out_features, in_features]``; ``scale`` and ``minimum`` float32
    ``[out_features, in_features // group_size]`` (after :meth:`use_q8_path` all three in the blocked layout of
    :func:`~llminfer.kernels.int8_group_linear.pack_int8_group_q8` and ``pack_group_q8_params``, the scale and
    minimum in the dtype of :func:`~llminfer.kernels.int8_group_linear.q8_params_dtype`). Input
    ``[..., in_features]`` (any float dtype) gives
    ``[..., out_features]`` of the input's dtype, computed by
    :func:`llminfer.kernels.int8_group_linear.int8_group_linear` (14-bit activations per row, exact integer sums
    per group, float32 out), or after :meth:`use_q8_path` by ``int8_group_linear_q8`` (activations as two 8-bit
    digits per block of 32); ``compute_dtype`` is not applied. Where that kernel cannot load, the weight is
    dequantized for each call (correct, slow); :func:`quantize_model` does not pick this layer there.

    Raises:
        ValueError: ``in_features`` is not a multiple of ``group_size``, or ``group_size`` is not one of
            :data:`llminfer.kernels.int8_group_linear.INT8_GROUP_SIZES`.
    """

    mode = "int8-wo"

    def __init__(self, linear: nn.Linear, group_size: int = 32, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        codes, scale, minimum = int8_group.quantize_int8_groupwise(linear.weight, group_size)
        super().__init__(linear, compute_dtype)
        self.group_size = group_size
        self.register_buffer("weight", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)

    #: The kernel op once it is known to load (None: not asked yet; False: it cannot), looked up once, not
    #: per call: a decode step makes one call per linear layer.
    _op: Any = None
    #: ``"wide"`` (``int8_group_linear``, 14-bit activations per row, codes row-major) or ``"q8"``
    #: (:meth:`use_q8_path`: ``int8_group_linear_q8``, two 8-bit digits per block of 32, codes in
    #: :func:`~llminfer.kernels.int8_group_linear.pack_int8_group_q8`'s order).
    kernel_path = "wide"

    def use_q8_path(self) -> bool:
        """Re-lay ``weight`` out in place for :func:`~llminfer.kernels.int8_group_linear.int8_group_linear_q8`
        and run every product there from now on, where the layer's groups are 32 columns and the kernel loads;
        return whether the layer is on that path. Idempotent.
        """
        if self.kernel_path == "q8":
            return True
        if self.group_size != 32 or self.weight.device.type != "cpu" or not int8_group.kernel_available():
            return False
        self.weight = int8_group.pack_int8_group_q8(self.weight)
        dtype = int8_group.q8_params_dtype(self.scale, self.minimum)  # bfloat16; float16 for a GGUF grid kept
        self.scale = int8_group.pack_group_q8_params(self.scale, dtype)
        self.minimum = int8_group.pack_group_q8_params(self.minimum, dtype)
        self.kernel_path = "q8"
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._op is None:
            type(self)._op = torch.ops.llminfer_cpu.int8_group_linear if int8_group.kernel_available() else False
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        bias = self.bias if self.bias is None or self.bias.dtype == torch.float32 else self.bias.float()
        if self.kernel_path == "q8" and x.device.type == "cpu":
            out = torch.ops.llminfer_cpu.int8_group_linear_q8(flat, self.weight, self.scale, self.minimum,
                                                             self.out_features, bias)
        elif self._op and x.device.type == "cpu":
            out = self._op(flat, self.weight, self.scale, self.minimum, self.group_size, bias)
        else:
            out = torch.nn.functional.linear(flat, self.dequantized_weight().to(flat.device), bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 ``[out_features, in_features]`` weight the layer computes with."""
        if self.kernel_path != "q8":
            return int8_group.dequantize_int8_groupwise(self.weight, self.scale, self.minimum)
        n = self.out_features
        return int8_group.dequantize_int8_groupwise(int8_group.unpack_int8_group_q8(self.weight, n),
                                                    int8_group.unpack_group_q8_params(self.scale, n),
                                                    int8_group.unpack_group_q8_params(self.minimum, n))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"


class Int4WeightOnlyLinear(_WeightOnlyLinear):
    """``nn.Linear`` replacement with a group-wise uint4 weight packed for torch's CPU int4 kernel.

    Buffers: ``weight`` uint8 ``[N_pad, in_features // 2]`` (two codes a byte, the kernel's packed layout;
    ``N_pad`` = ``out_features`` rounded up to 16, padding rows zero); ``scales_and_zeros``
    ``[in_features // group_size, N_pad, 2]`` in ``compute_dtype``. After :meth:`use_llminfer_kernel`,
    ``weight`` is uint8 ``[out_features, ceil(in_features / 128) * 64]`` in :func:`pack_int4_codes`'s layout,
    ``scales_and_zeros`` gives way to ``kernel_scales`` and ``kernel_zeros`` (float32; zero point less 8 *
    scale, i.e. the group's minimum) ``[out_features, in_features // group_size]``, and the products take
    llminfer's kernel (float32 activations rounded to 14 bits per row, not ``compute_dtype``). On the q8 path
    with groups of 32 the codes, ``kernel_scales`` and ``kernel_zeros`` are in the blocked layout of
    :func:`~llminfer.kernels.int8_group_linear.pack_int4_group_q8` and ``pack_group_q8_params`` (two-digit
    activations; the dtype of ``q8_params_dtype``: 2 bytes each for the quantizer's bfloat16 grid, or a GGUF
    file's float16 one). The kernel's scales and minima are the quantizer's own where the layer was built
    from a float weight (torch's layout rounds the zero point to ``compute_dtype``; the kernel then computes
    the quantizer's grid, not that rounding), else those of ``scales_and_zeros``. Input and output as
    :class:`Int8WeightOnlyLinear`, with the weight of :func:`dequantize_int4`.

    Raises:
        ValueError: ``group_size`` is not 32/64/128/256 or does not divide ``in_features``.
    """

    mode = "int4-wo"

    def __init__(self, linear: nn.Linear, group_size: int = 32, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        if linear.in_features % group_size:
            raise ValueError(f"int4 weight-only needs in_features % {group_size} == 0, got {linear.in_features}")
        super().__init__(linear, compute_dtype)
        self.group_size = group_size
        w = linear.weight.detach()
        pad = (-w.shape[0]) % _INT4_N_MULTIPLE
        w = torch.cat([w, w.new_zeros(pad, w.shape[1])]) if pad else w
        q, sz = quantize_int4_groupwise(w, group_size)
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_and_zeros", sz.to(compute_dtype))
        # The quantizer's grid where compute_dtype rounds it (a bfloat16 zero point, minimum + 8 * scale, is
        # not the bfloat16 minimum it came from): use_llminfer_kernel takes the scales and minima from it, in 2
        # bytes each where they are bfloat16 or float16 values, and drops it (drop_kernel_grid).
        self._kernel_grid: torch.Tensor | None = None if int8_group.is_exact_in(sz, compute_dtype) else sz
        q = q[: self.out_features].to(torch.uint8)  # two to a byte, for use_llminfer_kernel (_kept_codes)
        self._kernel_codes: torch.Tensor | None = q[:, 0::2] | (q[:, 1::2] << 4)

    #: Set by :meth:`use_llminfer_kernel`: ``weight`` then holds the codes in the layout of
    #: :func:`llminfer.kernels.int4_linear.int4_linear` (``kernel_path`` ``"wide"``) or of
    #: :func:`llminfer.kernels.q8_linear.int4_linear_q8` (``"q8"``; for groups of 32 of
    #: :func:`llminfer.kernels.int8_group_linear.int4_group_linear_q8`) and every product runs there.
    use_cpu_kernel = False
    kernel_path = "wide"

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, self.group_size, self.scales_and_zeros)
        return out[:, : self.out_features] if out.shape[1] != self.out_features else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_cpu_kernel:
            return super().forward(x)
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features).float().contiguous()
        bias = None if self.bias is None else self.bias.float()
        if self._blocked_q8:
            out = torch.ops.llminfer_cpu.int4_group_linear_q8(flat, self.weight, self.kernel_scales,
                                                             self.kernel_zeros, self.out_features, bias)
        else:
            product = int4_linear_q8 if self.kernel_path == "q8" else int4_linear
            out = product(flat, self.weight, self.kernel_scales, self.kernel_zeros, self.group_size, bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    @property
    def _blocked_q8(self) -> bool:
        """Whether the kernel state is in int4_group_linear_q8's blocked layout (the q8 path, groups of 32)."""
        return self.use_cpu_kernel and self.kernel_path == "q8" and self.group_size == 32

    def codes(self) -> torch.Tensor:
        """The int32 ``[out_features, in_features]`` codes in [0, 15] (of either layout)."""
        if self.use_cpu_kernel:
            if self._blocked_q8:
                return int8_group.unpack_int4_group_q8(self.weight, self.out_features)
            unpack = unpack_int4_codes_q8 if self.kernel_path == "q8" else unpack_int4_codes
            return unpack(self.weight, self.in_features)[: self.out_features]
        # torch's packed layout is opaque: its own kernel with scale 1 and zero point 8 computes
        # (q - 8) * 1 + 8 = q, and rows of the identity pick each column (exact: one term per output)
        n_pad = self.weight.shape[0]
        ones = torch.ones(self.in_features // self.group_size, n_pad, dtype=torch.bfloat16)
        sz = torch.stack([ones, ones * 8], dim=2)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        cols = [torch.ops.aten._weight_int4pack_mm_for_cpu(eye[i:i + 256], self.weight, self.group_size, sz)
                for i in range(0, self.in_features, 256)]
        return torch.cat(cols).t()[: self.out_features].round().to(torch.int32)

    def use_llminfer_kernel(self, path: str = "wide") -> None:
        """Re-lay ``weight`` out for :func:`llminfer.kernels.int4_linear.int4_linear` (``path="wide"``,
        :func:`pack_int4_codes`, the caller checks that the kernel has its VNNI path) or
        :func:`~llminfer.kernels.q8_linear.int4_linear_q8` (``"q8"``, :func:`pack_int4_codes_q8`; for groups of
        32 :func:`~llminfer.kernels.int8_group_linear.int4_group_linear_q8`, two-digit activations), without
        torch's row padding; replace ``scales_and_zeros`` by the kernel's ``kernel_scales`` /
        ``kernel_zeros`` buffers, and run every product there from now on. Idempotent (the first path stays).

        Raises:
            ValueError: ``path`` is neither ``"wide"`` nor ``"q8"``.
        """
        if path not in ("wide", "q8"):
            raise ValueError(f"int4 kernel path must be 'wide' or 'q8', got {path!r}")
        if self.use_cpu_kernel:
            return
        q = kept if (kept := self._kept_codes()) is not None else self.codes()
        grid = self._kernel_grid
        if grid is None or not torch.equal(grid.to(self.scales_and_zeros.dtype), self.scales_and_zeros):
            grid = self.scales_and_zeros  # none kept, or the buffer changed since (load_state_dict, an edit)
        sz = grid[:, : self.out_features].float()  # [K/G, N, 2]
        self.drop_kernel_grid()
        scales, zeros = sz[..., 0].t().contiguous(), sz[..., 1].t().contiguous()
        # The kernel's state replaces torch's: buffers (so state_dict, load_state_dict and the byte counts
        # see what the products read), under other names than torch's layout, so a state_dict of one layout
        # does not load into the other.
        del self.scales_and_zeros
        self.kernel_path, self.use_cpu_kernel = path, True
        kernel_zeros = (zeros - 8.0 * scales).contiguous()  # zero - 8 * scale
        if self._blocked_q8:  # int4_group_linear_q8's layout
            dtype = int8_group.q8_params_dtype(scales, kernel_zeros)  # 2 bytes from the quantizer's grid
            self.weight = int8_group.pack_int4_group_q8(q)
            scales = int8_group.pack_group_q8_params(scales, dtype)
            kernel_zeros = int8_group.pack_group_q8_params(kernel_zeros, dtype)
        else:
            self.weight = {"wide": pack_int4_codes, "q8": pack_int4_codes_q8}[path](q)
        self.register_buffer("kernel_scales", scales)  # float32 [N, K / G], or blocked for int4_group_linear_q8
        self.register_buffer("kernel_zeros", kernel_zeros)

    _kernel_grid: torch.Tensor | None = None
    _kernel_codes: torch.Tensor | None = None

    def _kept_codes(self) -> torch.Tensor | None:
        """The quantizer's codes (int32 ``[out_features, in_features]``) where torch's packing of them is still
        ``weight`` (not after load_state_dict; inference tensors have no version counter), else None. Reading
        torch's opaque layout back (:meth:`codes`) took 1.2-1.4 s of the built-in SmolLM2's load (Zen 4)."""
        if (kept := self._kernel_codes) is None:
            return None
        q = torch.stack((kept & 15, kept >> 4), dim=-1).view(self.out_features, self.in_features).int()
        padded = torch.cat([q, q.new_zeros(self.weight.shape[0] - self.out_features, q.shape[1])])
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded, 1)
        return q if packed.shape == self.weight.shape and torch.equal(packed, self.weight) else None

    def drop_kernel_grid(self) -> None:
        """Free the quantizer's float32 grid and the codes kept for :meth:`use_llminfer_kernel` (2 bits and 4
        bits a weight), where the layer stays on torch's kernel. Idempotent."""
        self._kernel_grid = self._kernel_codes = None

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 ``[out_features, in_features]`` weight the layer computes with."""
        if self.use_cpu_kernel:
            g, scales, zeros = self.group_size, self.kernel_scales, self.kernel_zeros
            if self._blocked_q8:
                scales = int8_group.unpack_group_q8_params(scales, self.out_features)
                zeros = int8_group.unpack_group_q8_params(zeros, self.out_features)
            return (self.codes().double() * scales.double().repeat_interleave(g, 1)
                    + zeros.double().repeat_interleave(g, 1)).float()
        sz = self.scales_and_zeros[:, : self.out_features].float()
        return dequantize_int4(self.codes(), sz, self.group_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


WEIGHT_ONLY_TYPES = (Int8WeightOnlyLinear, Int8GroupWeightOnlyLinear, Int4WeightOnlyLinear, Int6GroupWeightOnlyLinear)


# ----------------------------------------------------------------------------------------- model pass
def quantize_model(model: nn.Module, mode: str, *, group_size: int = 32, compute_dtype: torch.dtype = torch.bfloat16,
                   quantize_lm_head: bool = True, int4_lm_head: str = "int8",
                   int8_group_size: int = 32) -> dict[str, Any]:
    """Replace ``model``'s ``nn.Linear`` layers by weight-only quantized ones, in place.

    Only modules whose type is exactly ``nn.Linear`` are replaced (GPT-2's ``Conv1D`` projections, for
    one, stay as they are). The LM head is the output embedding; with tied embeddings it shares its weight
    with the input embedding, which keeps its float weight (the token lookup is unchanged) while the head
    gets its own quantized copy.

    Args:
        model: a transformers causal LM on CPU (float weights).
        mode: ``"int8-wo"`` or ``"int4-wo"``.
        group_size: int4 group size (32, 64, 128 or 256).
        compute_dtype: the kernels' activation dtype (see the module docstring).
        quantize_lm_head: replace the LM head too.
        int4_lm_head: with ``mode="int4-wo"``, the head's format: ``"int8"`` (int8-wo's), ``"int6"`` (6-bit
            groups, where llminfer's CPU kernel loads, else int8) or ``"int4"``.
        int8_group_size: int8 layers' (int8-wo's, and an int8 head's) input columns per scale and minimum
            (:class:`Int8GroupWeightOnlyLinear`), or 0 for one scale per output channel
            (:class:`Int8WeightOnlyLinear`). Where llminfer's CPU kernel cannot load, per channel.

    Returns ``{"quantized": [names], "skipped": {name: reason}}``; raises ValueError for an unknown ``mode``.
    """
    if mode not in ("int8-wo", "int4-wo"):
        raise ValueError(f"unknown weight-only mode {mode!r}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    report: dict[str, Any] = {"quantized": [], "skipped": {}}
    if int8_group_size and not int8_group.kernel_available():
        report["int8_format"] = "per channel (llminfer's CPU kernel for groups is not available)"
        int8_group_size = 0
    report.setdefault("int8_format", f"groups of {int8_group_size}" if int8_group_size else "per channel")
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        if linear is head and not quantize_lm_head:
            report["skipped"][name] = "quantize_lm_head is off"
            continue
        try:
            new: nn.Module
            if linear is head and mode == "int4-wo" and int4_lm_head == "int6" and int8_group.kernel_available():
                new = Int6GroupWeightOnlyLinear(linear, compute_dtype)
            elif mode == "int8-wo" or (linear is head and int4_lm_head in ("int8", "int6")):
                grouped = int8_group_size and linear.in_features % int8_group_size == 0
                new = (Int8GroupWeightOnlyLinear(linear, int8_group_size, compute_dtype) if grouped
                       else Int8WeightOnlyLinear(linear, compute_dtype))
            else:
                new = Int4WeightOnlyLinear(linear, group_size, compute_dtype)
        except ValueError as exc:
            report["skipped"][name] = str(exc)
            continue
        in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        new.tied_to_input_embedding = in_emb is not None and getattr(in_emb, "weight", None) is linear.weight
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        report["quantized"].append(name)
    return report


def drop_kernel_grids(model: nn.Module) -> None:
    """:meth:`Int4WeightOnlyLinear.drop_kernel_grid` on every int4-wo layer of ``model``: call it once the CPU
    kernels had their chance (the layers they took dropped theirs already)."""
    for module in model.modules():
        if isinstance(module, Int4WeightOnlyLinear):
            module.drop_kernel_grid()


def check_kernels_available() -> str | None:
    """Why torch's CPU weight-only kernels cannot run here, or None when they can (a tiny product each)."""
    try:
        lin = nn.Linear(32, 16, bias=False)
        x = torch.randn(1, 32)
        with torch.inference_mode():
            Int8WeightOnlyLinear(lin)(x)
            Int4WeightOnlyLinear(lin, 32)(x)
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return None
