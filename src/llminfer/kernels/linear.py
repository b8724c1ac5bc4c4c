"""The fp32 / int8 linear product on llminfer's CPU kernels: :func:`skinny_linear` (``csrc/skinny_linear.cpp``)
and the int8-wo layers' entry :func:`int8_linear` (``csrc/int8_linear.cpp``).

``skinny_linear`` is made for the decode step, where ``M`` (the step's rows) is small and the product is bound by
the weight bytes read: each thread reads a tile of output channels once for four activation rows at a time (for a
single row, one channel after another, so the tile is one sequential stream). Prefill-sized products run here too:
with more than four rows each thread holds a block of tiles' weights in L2 while every group of four rows passes
over it. The library must be loaded (:func:`llminfer.kernels.build.skinny_linear_available`).
"""

from __future__ import annotations

import torch


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` on the kernel.

    Args:
        x: float32 ``[M, K]``, contiguous, on CPU, ``K % 8 == 0``.
        weight: float32 or int8 ``[N, K]``, contiguous.
        scale: float32 ``[N]`` per-output-channel scale (int8 weights), or None.
        bias: float32 ``[N]``, or None.

    Returns:
        float32 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded, or the arguments break the rules above.
    """
    return torch.ops.llminfer_cpu.skinny_linear(x, weight, scale, bias)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` for an int8 ``weight``: on integer dot products where the
    kernel is the AVX-512 VNNI build (:func:`int8_activation_bits` is 14) and ``K % 32 == 0``,
    ``K <= 32768``; elsewhere exactly :func:`skinny_linear` (float32 activations).

    The integer path rounds each activation row on its own to 14 bits (``sx = max|x| / 8191`` in float32,
    ``q = round(x / sx)`` to nearest even), sums ``q * weight`` exactly (``vpdpwssd`` into int32 lanes, the
    lanes in int64) and returns ``float32(double(dot) * sx * scale) + bias``. Exact sums make a row's result
    independent of the batch, the threads and the order of the sums; against float32 activations it differs
    by the rounding of the activations (at most half a step of ``max|x| / 8191`` per element). A row holding
    a NaN or an infinity gives NaN outputs. The scheme is symmetric per-token activation quantization (as
    in ZeroQuant and SmoothQuant's W8A8) with 14 bits instead of 8, which keeps int8-wo's agreement with
    the float model (``bench/bench_quant.py``) while the products run on integer instructions.

    Args:
        x: float32 ``[M, K]``, contiguous, on CPU, ``K % 8 == 0``.
        weight: int8 ``[N, K]``, contiguous, values in [-127, 127].
        scale: float32 ``[N]`` per-output-channel scale.
        bias: float32 ``[N]``, or None.

    Returns:
        float32 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded, or the arguments break the rules above.
    """
    return torch.ops.llminfer_cpu.int8_linear(x, weight, scale, bias)
