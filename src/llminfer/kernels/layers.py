"""``nn.Linear`` stand-ins that run their products on llminfer's CPU kernels, holding the layer's own parameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llminfer.kernels.bf16_linear import BF16_KERNEL_MAX_ROWS, bf16_linear
from llminfer.kernels.linear import skinny_linear


def adopt_linear(module: nn.Linear, linear: nn.Linear) -> None:
    """Initialise ``module`` (an ``nn.Linear`` subclass standing in for ``linear``) with ``linear``'s own
    ``weight`` and ``bias`` parameters (not copies: ties and ``state_dict`` keys stay as they were), without
    ``nn.Linear.__init__``, which would allocate a second weight."""
    nn.Module.__init__(module)
    module.weight = linear.weight
    module.bias = linear.bias
    module.in_features = linear.in_features
    module.out_features = linear.out_features


class SkinnyLinear(nn.Linear):
    """A drop-in for an fp32 or bf16 ``nn.Linear`` that runs its products on :func:`skinny_linear` (fp32)
    or :func:`bf16_linear` (bf16, where :func:`~llminfer.kernels.build.bf16_kernel_available`).

    It is an ``nn.Linear`` holding the same ``weight`` and ``bias`` parameters (ties, ``state_dict`` keys
    and PEFT wrapping unchanged). Input ``[..., in_features]`` float32 on CPU with any number of rows, no
    autograd, gives ``[..., out_features]`` float32 from the kernel (the same bits for a row whatever the
    other rows); bf16 input likewise up to :data:`BF16_KERNEL_MAX_ROWS` rows, and ``F.linear`` (oneDNN)
    beyond, so a bf16 row's bits do depend on the step's size, as they do with torch alone. Anything else
    (another dtype or device, a non-contiguous weight, gradients) takes ``F.linear``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        adopt_linear(self, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.dtype != w.dtype or w.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu"
                or w.device.type != "cpu" or not w.is_contiguous()
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return F.linear(x, w, self.bias)
        rows = x.numel() // max(1, self.in_features)
        if w.dtype == torch.bfloat16 and rows > BF16_KERNEL_MAX_ROWS:
            return F.linear(x, w, self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()
        if w.dtype == torch.float32:
            out = skinny_linear(flat, w, None, self.bias)
        else:
            out = bf16_linear(flat, w, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


class KernelRMSNorm(nn.Module):
    """A drop-in for a Llama-family RMSNorm (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``MistralRMSNorm``) with a
    float32 weight: ``weight * (x * rsqrt(mean(x ** 2, -1) + eps))`` as one op (``csrc/rms_norm.cpp``) instead
    of torch's six, about 1 us instead of 40 at batch 1.

    It holds the norm's own ``weight`` parameter (``state_dict`` keys unchanged). Input ``[..., d]`` float32 on
    CPU, no autograd, gives ``[..., d]`` float32 that agrees with transformers' norm to float32 rounding (the
    sum of squares runs in another order); anything else takes transformers' operations.
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return torch.ops.llminfer_cpu.rms_norm(x, w, self.variance_epsilon)
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return w * (x.float() * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
