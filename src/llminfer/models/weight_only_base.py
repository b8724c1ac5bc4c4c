"""The base of the weight-only quantized linear layers (:mod:`llminfer.models.weight_only`,
:mod:`llminfer.models.weight_only_int6`)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["WeightOnlyLinear"]


class WeightOnlyLinear(nn.Linear):
    """Shared parts: an ``nn.Linear`` (for PEFT) holding no float weight, input cast to the kernel's dtype."""

    mode = ""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a float weight
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.compute_dtype = compute_dtype
        #: True for an LM head quantized from a weight it shared with the input embedding.
        self.tied_to_input_embedding = False
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype)
        # The AVX kernels use aligned 16-byte loads of the activation rows. Under torch.compile inductor's
        # buffers are aligned and a data pointer cannot be traced, so only eager checks it.
        if not flat.is_contiguous() or (not torch.compiler.is_compiling() and flat.data_ptr() % 64):
            flat = flat.clone(memory_format=torch.contiguous_format)
        out = self._kernel(flat).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"mode={self.mode}, compute_dtype={str(self.compute_dtype).replace('torch.', '')}")

    def quantized_bytes(self) -> int:
        """Bytes of the quantized weight and its scales (bias excluded)."""
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))
