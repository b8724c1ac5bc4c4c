"""The weight-only quantizers of :mod:`llminfer.models.weight_only`'s layers: symmetric per-channel int8 and
torch's group-wise int4 layout (int8-wo's group-wise format is :mod:`llminfer.kernels.int8_group_linear`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from llminfer.kernels.int8_group_linear import bfloat16_ceil, bfloat16_floor, float16_nearest, grid_reproduces

INT4_GROUP_SIZES = (32, 64, 128, 256)


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8.

    Args:
        weight: ``[N, K]`` float.

    Returns:
        ``(q, scales)``: ``q`` int8 ``[N, K]`` in [-127, 127], ``scales`` float32 ``[N]`` with
        ``weight ≈ q * scales[:, None]`` (an all-zero row gets scale 1, not 0).
    """
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4_groupwise(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise uint4 in torch's tinygemm layout.

    Args:
        weight: ``[N, K]`` float with ``K % group_size == 0``.
        group_size: input columns sharing one scale and zero point.

    Returns:
        ``(q, scales_and_zeros)``: ``q`` int32 ``[N, K]`` codes in [0, 15]; ``scales_and_zeros`` float32
        ``[K // group_size, N, 2]`` (``[..., 0]`` the scale, ``[..., 1]`` the zero point) with
        ``weight[n, k] ≈ (q[n, k] - 8) * scale[g, n] + zero[g, n]``, ``g = k // group_size``. The scale and
        ``zero - 8 * scale`` (the group's minimum) are bfloat16 values (the minimum rounded down, the scale up,
        then the codes), unless the weight already lies on such a grid (a GGUF file's Q4_0 or Q4_1 blocks),
        which is then kept, in float16 values where they reproduce it.

    Raises:
        ValueError: ``K`` is not a multiple of ``group_size``.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    for rounding in (float16_nearest, lambda t: t):  # GGUF's fp16 block scales and minima, else float32
        if not grid_reproduces(weight[:8], dequantize_int4(*_int4_grid(groups[:8], rounding, rounding), group_size)):
            continue  # an ordinary weight fails on a few rows, before the whole tensor is quantized twice more
        exact = _int4_grid(groups, rounding, rounding)
        if grid_reproduces(weight, dequantize_int4(*exact, group_size)):
            return exact
    # The q8 layout keeps the scale and the minimum (zero - 8 * scale) in 2 bytes where both are bfloat16 values
    return _int4_grid(groups, bfloat16_floor, bfloat16_ceil)


def _int4_grid(groups: torch.Tensor, floor: Callable[[torch.Tensor], torch.Tensor],
               ceil: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int4_groupwise on ``groups`` ``[N, K / G, G]``, the minima rounded by ``floor`` and the scales by
    ``ceil`` before the codes are computed (the grid still covers the group)."""
    lo = floor(groups.amin(dim=2, keepdim=True))
    hi = groups.amax(dim=2, keepdim=True)
    scales = ceil((hi - lo).clamp(min=1e-6) / 15.0)
    zeros = lo + 8.0 * scales
    q = torch.round((groups - lo) / scales).clamp_(0, 15).to(torch.int32)
    q = q.reshape(groups.shape[0], groups.shape[1] * groups.shape[2])
    scales_and_zeros = torch.stack([scales.squeeze(2), zeros.squeeze(2)], dim=2).transpose(0, 1).contiguous()
    return q, scales_and_zeros


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 ``[N, K]`` weight that codes from :func:`quantize_int4_groupwise` stand for."""
    n, k = q.shape
    s = scales_and_zeros[..., 0].float().t().unsqueeze(2)  # [N, K/G, 1]
    z = scales_and_zeros[..., 1].float().t().unsqueeze(2)
    return ((q.reshape(n, k // group_size, group_size).float() - 8.0) * s + z).reshape(n, k)
