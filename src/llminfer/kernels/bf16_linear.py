"""bf16 products on AVX-512 BF16 (``vdpbf16ps``, ``csrc/bf16_linear.cpp``): the op's wrapper :func:`bf16_linear`
and how many rows a product may have to take it (:data:`BF16_KERNEL_MAX_ROWS`)."""

from __future__ import annotations

import torch

#: bf16 products of at most this many rows run on :func:`bf16_linear`; larger ones on torch's matmul (oneDNN, AMX
#: where the CPU has it): ``vdpbf16ps`` retires no more products per cycle than fp32 FMAs, so past a few rows
#: AMX wins (figures: the README's CPU kernel section, ``bench/bench_cpu_kernels.py``).
BF16_KERNEL_MAX_ROWS = 4


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for bf16 ``x`` and ``weight`` on ``vdpbf16ps`` (AVX-512 BF16).

    Each output element is accumulated in float32 in one fixed order (16 lanes of pairwise bf16 products
    over ``k``, a fixed lane sum, then the bias) and rounded once to bf16 (nearest even), so a row's result
    does not depend on the other rows, the thread count or the row's place in a tile. Against a float64
    reference it differs by float32 accumulation and that one bf16 rounding; denormal inputs count as zero
    (the instruction's rule).

    Args:
        x: bfloat16 ``[M, K]``, contiguous, on CPU, ``K % 32 == 0``.
        weight: bfloat16 ``[N, K]``, contiguous.
        bias: bfloat16 or float32 ``[N]``, or None.

    Returns:
        bfloat16 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded or has no BF16 path
            (:func:`~llminfer.kernels.build.bf16_kernel_available`), or the arguments break the rules above.
    """
    return torch.ops.llminfer_cpu.bf16_linear(x, weight, bias)
