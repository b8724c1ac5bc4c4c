"""Group-wise int4 products on AVX-512 VNNI integer dot products (``csrc/int4_linear.cpp``): the op's wrapper
:func:`int4_linear` and the code layout it reads (:func:`pack_int4_codes`)."""

from __future__ import annotations

import torch


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for group-wise int4 weights ``W[n, k] = q[n, k] * scale[n, g] + zero[n, g]``
    (``g = k // group_size``), on AVX-512 VNNI integer dot products (:func:`int8_activation_bits` is 14).

    Activations are rounded per row to 14 bits as in :func:`int8_linear`; each group's dot product with
    the codes is exact (int32), then added in float32 times the group's scale, in one fixed order, with the
    zero points' term from each group's sum of the rounded activations. A row's result does not depend on
    the other rows or the threads. The scheme is llama.cpp's Q4_0 / Q4_1 block dot product with 14-bit
    instead of 8-bit activations.

    Args:
        x: float32 ``[M, K]``, contiguous, on CPU.
        codes: uint8 ``[N, ceil(K / 128) * 64]`` from :func:`pack_int4_codes`
            (four codes to a 16-bit word).
        scale, zero: float32 ``[N, K // group_size]``, contiguous, on CPU (``zero`` is the layer's zero point
            less ``8 * scale`` for :class:`~llminfer.models.weight_only.Int4WeightOnlyLinear`'s codes).
        group_size: 32, 64, 128 or 256, dividing ``K``; ``0 < K <= 32768``.
        bias: float32 ``[N]``, or None.

    Returns:
        float32 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded or has no VNNI path, or the arguments break the rules above.
    """
    return torch.ops.llminfer_cpu.int4_linear(x, codes, scale, zero, group_size, bias)


def pack_int4_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15] in the layout of :func:`int4_linear`.

    Args:
        q: integer ``[N, K]`` with ``K % 32 == 0``.

    Returns:
        uint8 ``[N, ceil(K / 128) * 64]``: each run of 128 columns from ``k0`` is 32 little-endian 16-bit words,
        word ``i`` holding ``q[:, k0 + 32 * j + i]`` in its nibble ``j`` (a shorter last run has zero nibbles
        where it has no columns).
    """
    n, k = q.shape
    runs = -(-k // 128)
    padded = torch.zeros(n, runs * 128, dtype=torch.int32)
    padded[:, :k] = q
    nib = padded.reshape(n, runs, 4, 32)  # [n, run, j, i]
    words = nib[:, :, 0] | (nib[:, :, 1] << 4) | (nib[:, :, 2] << 8) | (nib[:, :, 3] << 12)  # [n, run, 32]
    return torch.stack([words & 0xFF, words >> 8], dim=3).to(torch.uint8).reshape(n, runs * 64).contiguous()


def unpack_int4_codes(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The inverse of :func:`pack_int4_codes`: int32 ``[N, in_features]``."""
    n = packed.shape[0]
    b = packed.to(torch.int32).reshape(n, -1, 32, 2)
    words = b[..., 0] | (b[..., 1] << 8)  # [n, run, 32]
    nib = torch.stack([(words >> (4 * j)) & 0x0F for j in range(4)], dim=2)  # [n, run, j, i]
    return nib.reshape(n, -1)[:, :in_features].contiguous()
