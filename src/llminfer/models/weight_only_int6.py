"""int4-wo's LM head at 6 bits: :class:`Int6GroupWeightOnlyLinear`.

llama.cpp's Q4_0 files keep the output matrix at 6 bits (Q6_K): at 4 bits the head flips many top-1 tokens
(README, the int4-head row), at 8 bits it is most of what a small model's decode step reads. This is
int8-wo's group-wise format at 6 bits (:func:`~llminfer.kernels.int8_group_linear.quantize_int6_groupwise`:
codes in [0, 63], per group of 32 columns the closer of the min-max and the symmetric grid, bfloat16 scale and
minimum), 7 bits a weight with its parameters, on ``int6_group_linear_q8``: the int8 kernel's two-digit
activations, exact integer group sums and fixed float order, with the top two bits of each code unpacked from
their own vectors. A row's result does not depend on the batch, and on the same codes it has the int8 kernel's
bits.
"""

from __future__ import annotations

import torch
from torch import nn

from llminfer.kernels import int8_group_linear as int8_group
from llminfer.models.weight_only_base import WeightOnlyLinear

__all__ = ["Int6GroupWeightOnlyLinear"]


class Int6GroupWeightOnlyLinear(WeightOnlyLinear):
    """``nn.Linear`` replacement with 6-bit group-wise codes (groups of 32), on llminfer's CPU kernel only.

    Buffers: ``weight`` uint8 ``[ceil(N / L), 3 * L * K // 4]`` (:func:`~llminfer.kernels.int8_group_linear.pack_int6_group_q8`),
    ``scale`` and ``minimum`` ``[ceil(N / L), K // 32 * L]`` (``pack_group_q8_params``, bfloat16). Input
    ``[..., in_features]`` (any float dtype, computed in float32) gives ``[..., out_features]`` of the input's
    dtype; ``compute_dtype`` is not applied.

    Raises:
        ValueError: ``in_features`` is not a multiple of 32.
        RuntimeError: llminfer's CPU kernel is not loaded (:func:`~llminfer.kernels.int8_group_linear.kernel_available`).
    """

    mode = "int4-wo"
    group_size = 32
    kernel_path = "q8"

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        if not int8_group.kernel_available():
            raise RuntimeError("the 6-bit head needs llminfer's CPU kernel")
        codes, scale, minimum = int8_group.quantize_int6_groupwise(linear.weight)
        super().__init__(linear, compute_dtype)
        dtype = int8_group.q8_params_dtype(scale, minimum)
        self.register_buffer("weight", int8_group.pack_int6_group_q8(codes))
        self.register_buffer("scale", int8_group.pack_group_q8_params(scale, dtype))
        self.register_buffer("minimum", int8_group.pack_group_q8_params(minimum, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        bias = self.bias if self.bias is None or self.bias.dtype == torch.float32 else self.bias.float()
        out = torch.ops.llminfer_cpu.int6_group_linear_q8(flat, self.weight, self.scale, self.minimum,
                                                         self.out_features, bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def codes(self) -> torch.Tensor:
        """The int32 ``[out_features, in_features]`` codes in [0, 63]."""
        return int8_group.unpack_int6_group_q8(self.weight, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 ``[out_features, in_features]`` weight the layer computes with."""
        n = self.out_features
        return int8_group.dequantize_int8_groupwise(self.codes(), int8_group.unpack_group_q8_params(self.scale, n),
                                                    int8_group.unpack_group_q8_params(self.minimum, n))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", bits=6, group_size=32"
