"""int8 and int4 weight-only products on 8-bit activations, the "q8" path (``csrc/int8_linear_q8.cpp``,
``csrc/int4_linear_q8.cpp``, every x86 build): the ops' wrappers and the int4 code layout they read
(:func:`pack_int4_codes_q8`). Which of these or the wide path (:mod:`llminfer.kernels.linear`,
:mod:`llminfer.kernels.int4_linear`) a layer takes is :func:`llminfer.kernels.path_choice.quant_paths`'s choice."""

from __future__ import annotations

import torch


def int8_linear_q8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` for an int8 ``weight`` on u8 x s8 integer dot products
    with 8-bit activations (the "q8" path; source: ``csrc/int8_linear_q8.cpp``).

    Each activation row is rounded per block of 32 columns as llama.cpp's Q8_0 does
    (``d = max|x| / 127`` in float32, ``q = round(x / d)`` to nearest even). The products of a block run on
    ``vpdpbusd`` (AVX-512 VNNI, 64 columns an instruction; AVX-VNNI, 32), the weights made unsigned with
    ``w + 128`` and each lane started at ``-128 * sum(q)`` of its columns, or on ``vpmaddubsw`` (plain AVX2)
    with llama.cpp's sign trick (``|q|`` times ``w`` with ``q``'s sign): exact int32 lane sums either way.
    Each lane's sum is added in float32 times its block's ``d``, then the lanes in a fixed order, times
    ``scale``, plus ``bias``: one fixed sequence per output element, so a row's result does not depend on
    the batch or the threads. Against the float product the error is the activation rounding:
    ``|out - x @ W.T| <= scale[n] * sum_k |weight[n, k]| * d[b(k)] / 2`` plus float32 sums. A block holding
    a NaN or an infinity makes the row's outputs NaN.

    Args:
        x: float32 ``[M, K]``, contiguous, on CPU, ``K % 32 == 0``.
        weight: int8 ``[N, K]``, contiguous, values in [-127, 127] (-128 would break the sign trick).
        scale: float32 ``[N]`` per-output-channel scale.
        bias: float32 ``[N]``, or None.

    Returns:
        float32 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded, or the arguments break the rules above.
    """
    return torch.ops.llminfer_cpu.int8_linear_q8(x, weight, scale, bias)


def int4_linear_q8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for group-wise int4 weights ``W[n, k] = q[n, k] * scale[n, g] + zero[n, g]`` on u8 x
    s8 integer dot products with 8-bit activations (the "q8" path, any x86 build).

    Activations are rounded per block of 32 columns as in :func:`int8_linear_q8`; the codes are the
    unsigned operand (``vpdpbusd``, or ``vpmaddubsw`` on plain AVX2), each lane's exact sum is added in
    float32 times its block's ``d`` and its group's scale, and the zero points' term uses each group's sum of
    the float32 activations. llama.cpp's Q4_1 x Q8_0 block product, with llminfer's layout and group sizes.
    A row's result does not depend on the other rows or the threads.

    Args:
        x: float32 ``[M, K]``, contiguous, on CPU.
        codes: uint8 ``[N, ceil(K / 128) * 64]`` from
            :func:`pack_int4_codes_q8`.
        scale, zero: float32 ``[N, K // group_size]``, contiguous, on CPU.
        group_size: 32, 64, 128 or 256, dividing ``K``.
        bias: float32 ``[N]``, or None.

    Returns:
        float32 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded, or the arguments break the rules above.
    """
    return torch.ops.llminfer_cpu.int4_linear_q8(x, codes, scale, zero, group_size, bias)


def pack_int4_codes_q8(q: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15] in the layout of :func:`int4_linear_q8`.

    Args:
        q: integer ``[N, K]`` with ``K % 32 == 0``.

    Returns:
        uint8 ``[N, ceil(K / 128) * 64]``: each run of 128 columns from ``k0`` is 64 bytes, byte ``i`` holding
        ``q[:, k0 + i]`` in its low nibble and ``q[:, k0 + 64 + i]`` in its high one (zero nibbles where a
        shorter last run has no columns).
    """
    n, k = q.shape
    runs = -(-k // 128)
    padded = torch.zeros(n, runs * 128, dtype=torch.int32)
    padded[:, :k] = q
    nib = padded.reshape(n, runs, 2, 64)  # [n, run, half, i]
    return (nib[:, :, 0] | (nib[:, :, 1] << 4)).to(torch.uint8).reshape(n, runs * 64).contiguous()


def unpack_int4_codes_q8(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The inverse of :func:`pack_int4_codes_q8`: int32 ``[N, in_features]``."""
    n = packed.shape[0]
    b = packed.to(torch.int32).reshape(n, -1, 64)
    return torch.stack([b & 0x0F, b >> 4], dim=2).reshape(n, -1)[:, :in_features].contiguous()
