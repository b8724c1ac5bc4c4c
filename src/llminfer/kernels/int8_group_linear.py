"""int8-wo's group-wise format: 8-bit codes with a scale and a minimum per group of input columns.

``W[n, k] ≈ codes[n, k] * scale[n, g] + minimum[n, g]`` for ``g = k // group_size``, codes uint8 in
[0, 255]. Per group the quantizer tries two grids and keeps the one with the smaller squared error:

- asymmetric: ``minimum`` the group's minimum, ``scale = (max - min) / 255`` (the min-max grid of GGUF's
  Q4_1 and Q5_1 blocks, at 8 bits);
- symmetric: ``scale = max|W| / 127``, ``minimum = -128 * scale``, ``codes = round(W / scale) + 128``
  (exactly GGUF's Q8_0 block, ``d * q`` with ``q`` in [-127, 127]).

Groups of 32 are the block size of llama.cpp's Q8_0, and the reason for the format: a per-output-channel
scale (:func:`llminfer.models.weight_only.quantize_int8_per_channel`) spends its 255 levels on the
channel's largest weight, which trained weights' outliers make coarse for every other group. And because
both grids are tried, weights that were themselves dequantized from a Q8_0, Q4_0 or Q4_1 GGUF (every
trained model llminfer ships) come back on their own grid, up to float rounding: re-quantizing them loses
nothing.

The product is :func:`int8_group_linear`, llminfer's CPU kernel (``kernels/csrc/int8_group_linear.cpp``) on every
x86 build: AVX2 (``vpmaddwd``), AVX-512 and AVX-512 VNNI (``vpdpwssd``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llminfer.kernels import build

INT8_GROUP_SIZES = (32, 64, 128, 256)

_fake_registered = False

_BF16_DROPPED = 0xFFFF  # the float32 bits below a bfloat16's 8-bit mantissa


def bfloat16_floor(t: torch.Tensor) -> torch.Tensor:
    """The largest bfloat16 value at most ``t``, elementwise, as float32 (same shape). Infinities and NaN
    stay as they are.

    The group quantizers round their minima down and their scales up with it (:func:`bfloat16_ceil`) and then
    compute the codes, so the grid still covers the group and the q8 layout keeps both in 2 bytes exactly
    (:func:`q8_params_dtype`).
    """
    return _bfloat16_toward(t, up=False)


def bfloat16_ceil(t: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value at least ``t``, elementwise, as float32 (see :func:`bfloat16_floor`)."""
    return _bfloat16_toward(t, up=True)


def is_exact_in(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value of ``t`` is a value of ``dtype`` (a float dtype; NaN counts as one)."""
    x = t.float()
    return bool(((x.to(dtype).float() == x) | x.isnan()).all())


def grid_reproduces(weight: torch.Tensor, dequantized: torch.Tensor) -> bool:
    """Whether ``dequantized`` is within ``2**-20 * max|weight|`` of ``weight`` everywhere (float32 rounding of
    the grid's products, with the tensor's largest value as the yardstick): the weight already lies on the
    quantizer's grid, as a GGUF file's Q8_0 or Q4_1 blocks do."""
    w = weight.detach().float()
    return bool((dequantized - w).abs().max() <= 2.0**-20 * w.abs().max()) if w.numel() else True


def float16_nearest(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to the nearest float16 value, as float32 (out of range: infinity)."""
    return t.half().float()


def _bfloat16_toward(t: torch.Tensor, up: bool) -> torch.Tensor:
    x = t.float().contiguous()
    bits = x.view(torch.int32)
    toward_zero = bits & ~_BF16_DROPPED  # dropping the low 16 bits rounds the magnitude down
    inexact = (bits & _BF16_DROPPED) != 0
    away = inexact & ((x > 0) if up else (x < 0))  # one bfloat16 step further from zero
    out = (toward_zero + away.to(torch.int32) * (_BF16_DROPPED + 1)).view(torch.float32)
    return torch.where(x.isnan(), x, out)  # a NaN whose payload sits in the dropped bits would become inf


def quantize_int8_groupwise(weight: torch.Tensor, group_size: int = 32
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise 8-bit codes, per group the asymmetric or the symmetric grid, whichever is closer.

    Args:
        weight: ``[N, K]`` float, ``K % group_size == 0``.
        group_size: input columns per group (one of :data:`INT8_GROUP_SIZES`).

    Returns:
        ``(codes, scale, minimum)``: ``codes`` uint8 ``[N, K]``; ``scale`` and ``minimum`` float32
        ``[N, K // group_size]``, with ``weight ≈ codes * scale + minimum`` per group (an all-equal group
        gets ``scale`` 1 and its value as ``minimum`` where that is a bfloat16). Both hold bfloat16 values (the
        minimum rounded down, the scale up, then the codes: :func:`pack_group_q8_params` stores them in 2
        bytes exactly), unless the weight already lies on such a grid (:func:`grid_reproduces`: a GGUF file's
        Q8_0 or Q4_1 blocks), which is then kept, in float16 values where they reproduce it.

    Raises:
        ValueError: ``group_size`` is not one of :data:`INT8_GROUP_SIZES` or does not divide ``K``.
    """
    if group_size not in INT8_GROUP_SIZES:
        raise ValueError(f"int8 group size must be one of {INT8_GROUP_SIZES}, got {group_size}")
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int8 groups of {group_size} need in_features % {group_size} == 0, got {k}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    # A weight already on such a grid (a GGUF file's blocks) is kept exactly: with float16 values where they
    # do (GGUF's block scales are fp16), else float32; any other weight gets bfloat16 values.
    for rounding in (float16_nearest, lambda t: t):
        # a few rows first: an ordinary weight fails there, before the whole tensor is quantized twice more
        if not grid_reproduces(weight[:8], dequantize_int8_groupwise(*_int8_grids(w[:8], rounding, rounding))):
            continue
        exact = _int8_grids(w, rounding, rounding)
        if grid_reproduces(weight, dequantize_int8_groupwise(*exact)):
            return exact
    return _int8_grids(w, bfloat16_floor, bfloat16_ceil)


def _int8_grids(w: torch.Tensor, floor: Callable[[torch.Tensor], torch.Tensor],
                ceil: Callable[[torch.Tensor], torch.Tensor], levels: int = 255
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_int8_groupwise on ``w`` ``[N, groups, G]`` with the minima rounded by ``floor`` and the
    scales by ``ceil`` before the codes are computed, for codes in ``[0, levels]`` (255; 63 for 6 bits, whose
    symmetric grid is then ``d * q``, ``q`` in [-31, 31], stored as ``q + 32``)."""
    n = w.shape[0]
    half = levels // 2  # 127: the symmetric grid's largest step count
    lo, hi = floor(w.amin(-1)), w.amax(-1)

    a_scale = ceil((hi - lo) / float(levels))
    a_scale = torch.where(a_scale > 0, a_scale, torch.ones_like(a_scale))
    a_codes = torch.round((w - lo[..., None]) / a_scale[..., None]).clamp_(0, levels)
    a_err = ((a_codes * a_scale[..., None] + lo[..., None]) - w).square().sum(-1)

    s_scale = ceil(torch.maximum(hi.abs(), lo.abs()) / float(half))
    s_scale = torch.where(s_scale > 0, s_scale, torch.ones_like(s_scale))
    s_q = torch.round(w / s_scale[..., None]).clamp_(-half, half)
    s_min = -(half + 1.0) * s_scale
    s_err = ((s_q + half + 1.0) * s_scale[..., None] + s_min[..., None] - w).square().sum(-1)

    sym = s_err < a_err
    codes = torch.where(sym[..., None], s_q + half + 1.0, a_codes).to(torch.uint8).reshape(n, w.shape[1] * w.shape[2])
    scale = torch.where(sym, s_scale, a_scale).contiguous()
    minimum = torch.where(sym, s_min, lo).contiguous()
    return codes, scale, minimum


def quantize_int6_groupwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise 6-bit codes (groups of 32; int4-wo's LM head, as llama.cpp's Q4_0 files keep theirs at 6
    bits): :func:`quantize_int8_groupwise`'s two grids with 63 steps, the minimum rounded down and the scale up
    to bfloat16 values.

    Args:
        weight: ``[N, K]`` float, ``K % 32 == 0``.

    Returns:
        ``(codes, scale, minimum)``: ``codes`` uint8 ``[N, K]`` in [0, 63]; ``scale`` and ``minimum`` float32
        ``[N, K // 32]`` holding bfloat16 values, ``weight ≈ codes * scale + minimum`` per group.

    Raises:
        ValueError: ``K`` is not a multiple of 32.
    """
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"int6 groups of 32 need in_features % 32 == 0, got {k}")
    return _int8_grids(weight.detach().float().reshape(n, k // 32, 32), bfloat16_floor, bfloat16_ceil, levels=63)


def dequantize_int8_groupwise(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weight of :func:`quantize_int8_groupwise`'s output."""
    group_size = codes.shape[1] // scale.shape[1]
    return (codes.float() * scale.repeat_interleave(group_size, 1)
            + minimum.repeat_interleave(group_size, 1))


def kernel_available() -> bool:
    """Whether :func:`int8_group_linear` can run here (llminfer's CPU kernel loads, building it on the first
    call)."""
    if not build.skinny_linear_available():
        return False
    _register_fake()
    return hasattr(torch.ops.llminfer_cpu, "int8_group_linear")


def _register_fake() -> None:
    """A shape-only implementation, so torch.compile traces through the op (once per process)."""
    global _fake_registered
    if _fake_registered:
        return

    @torch.library.register_fake("llminfer_cpu::int8_group_linear")
    def _int8_group_linear_fake(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], codes.shape[0], dtype=torch.float32)

    @torch.library.register_fake("llminfer_cpu::int8_group_linear_q8")
    def _int8_group_linear_q8_fake(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                                   out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features, dtype=torch.float32)

    @torch.library.register_fake("llminfer_cpu::int6_group_linear_q8")
    def _int6_group_linear_q8_fake(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                                   out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features, dtype=torch.float32)

    @torch.library.register_fake("llminfer_cpu::int4_group_linear_q8")
    def _int4_group_linear_q8_fake(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                                   out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features, dtype=torch.float32)

    _fake_registered = True


def int8_group_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                      group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for group-wise 8-bit weights, on llminfer's CPU kernel.

    Activations are rounded per row to 14 bits (``max|x| / 8191`` steps) and the products are exact integer
    dot products per group (llama.cpp's block dot product of a Q4_1-style block, at 8 bits); a row's result
    does not depend on the other rows or the threads.

    Args:
        x: float32 ``[M, K]``, contiguous.
        codes: uint8 ``[N, K]``, contiguous.
        scale, minimum: float32 ``[N, K // group_size]``, contiguous.
        group_size: 32, 64, 128 or 256, dividing ``K``.
        bias: float32 ``[N]`` or None.

    Returns:
        float32 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded, or the arguments break the rules above.
    """
    if not kernel_available():
        raise RuntimeError("int8_group_linear: llminfer's CPU kernel is not loaded "
                           f"({build.unavailable_reason() or 'unknown reason'})")
    return torch.ops.llminfer_cpu.int8_group_linear(x, codes, scale, minimum, group_size, bias)


def int8_group_linear_q8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                         out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`int8_group_linear`'s product for groups of 32 on 8-bit activations (the "q8" path,
    ``csrc/int8_group_linear_q8.cpp``, every x86 build), with the weight in the blocked layout of
    :func:`pack_int8_group_q8` and :func:`pack_group_q8_params`.

    Activations are two 8-bit digits per value, per block of 32 columns: ``q = round(x / d)`` with
    ``d = max|x| / 127`` (llama.cpp's Q8_0) and the remainder on a 254 times finer grid. Each group's integer sum
    of codes times digits is exact (``vpdpbusd``; on plain AVX2 ``vpmaddwd`` on ``254 q + r``), then
    ``sum_g (dot_g * d[g] * scale[n, g] + minimum[n, g] * xsum[g])`` in float32 (``xsum`` the group's sum of the
    float32 activations), in one fixed order: a row's result does not depend on the other rows or the threads.
    Against the float product the error is the activation rounding, at most ``sum_k |W[n, k]| * d[g(k)] / 508``,
    plus float32 sums.

    Args:
        x: float32 ``[M, K]``, contiguous, ``K % 32 == 0``.
        codes: uint8 from :func:`pack_int8_group_q8`.
        scale, minimum: float32, bfloat16 or float16 (both the same) from :func:`pack_group_q8_params`.
        out_features: ``N``.
        bias: float32 ``[N]`` or None.

    Returns:
        float32 ``[M, N]``.

    Raises:
        RuntimeError: the kernel is not loaded, or the arguments break the rules above.
    """
    if not kernel_available():
        raise RuntimeError("int8_group_linear_q8: llminfer's CPU kernel is not loaded "
                           f"({build.unavailable_reason() or 'unknown reason'})")
    return torch.ops.llminfer_cpu.int8_group_linear_q8(x, codes, scale, minimum, out_features, bias)


def group_q8_lanes() -> int:
    """Output channels per block of the q8 group layout in the loaded build: 16 (AVX-512 VNNI) or 8.

    Raises:
        RuntimeError: the kernel is not loaded.
    """
    if not kernel_available():
        raise RuntimeError(f"llminfer's CPU kernel is not loaded ({build.unavailable_reason() or 'unknown reason'})")
    return int(torch.ops.llminfer_cpu.group_q8_lanes())


def _blocked(t: torch.Tensor, lanes: int) -> torch.Tensor:
    """``t`` ``[N, ...]`` padded with zero rows to a multiple of ``lanes``."""
    pad = -t.shape[0] % lanes
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack_int8_group_q8(codes: torch.Tensor) -> torch.Tensor:
    """Row-major codes ``[N, K]`` (groups of 32) in :func:`int8_group_linear_q8`'s layout: uint8
    ``[ceil(N / L), L * K]`` with ``L = group_q8_lanes()``: per block of ``L`` channels, group by group, 8 chunks
    of 4 columns, each chunk the ``L`` channels' 4 bytes side by side (the last block padded with zero codes).

    Raises:
        RuntimeError: the kernel is not loaded.
    """
    lanes = group_q8_lanes()
    n, k = codes.shape
    blocks = _blocked(codes, lanes).reshape(-1, lanes, k // 32, 8, 4)  # [block, lane, group, chunk, byte]
    return blocks.permute(0, 2, 3, 1, 4).reshape(-1, lanes * k).contiguous()


def unpack_int8_group_q8(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of :func:`pack_int8_group_q8`: row-major ``[out_features, K]``.

    Raises:
        RuntimeError: the kernel is not loaded.
    """
    lanes = group_q8_lanes()
    k = packed.shape[1] // lanes
    blocks = packed.reshape(-1, k // 32, 8, lanes, 4).permute(0, 3, 1, 2, 4)
    return blocks.reshape(-1, k)[:out_features].contiguous()


def q8_params_dtype(*params: torch.Tensor) -> torch.dtype:
    """The dtype :func:`pack_group_q8_params` keeps a layer's scales and minima in: bfloat16 where every value of
    every tensor is one (what the quantizers give), else float16 where every value is one (a GGUF file's
    fp16 block scales and minima, kept by the quantizers), else float32."""
    for dtype in (torch.bfloat16, torch.float16):
        if all(is_exact_in(p, dtype) for p in params):
            return dtype
    return torch.float32


def pack_group_q8_params(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-group scales or minima (zero points) ``[N, K // 32]`` in the q8 group layout: ``dtype`` (float32, or
    bfloat16 or float16 where :func:`q8_params_dtype` allows it; the op takes the scale and the minimum in one
    dtype)
    ``[ceil(N / L), K // 32 * L]``, per block of ``L`` channels the groups in order, each the ``L`` channels'
    values side by side.

    Raises:
        RuntimeError: the kernel is not loaded.
    """
    lanes = group_q8_lanes()
    groups = t.shape[1]
    blocked = _blocked(t.to(dtype), lanes).reshape(-1, lanes, groups)
    return blocked.transpose(1, 2).reshape(-1, groups * lanes).contiguous()


def unpack_group_q8_params(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of :func:`pack_group_q8_params`: float32 ``[out_features, K // 32]``.

    Raises:
        RuntimeError: the kernel is not loaded.
    """
    lanes = group_q8_lanes()
    groups = packed.shape[1] // lanes
    return packed.reshape(-1, groups, lanes).transpose(1, 2).reshape(-1, groups)[:out_features].float().contiguous()


# ------------------------------------------------------------------------------------ int4 codes, groups of 32
def int4_group_linear_q8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                         out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`int8_group_linear_q8`'s product for group-wise 4-bit codes (int4-wo's groups of 32):
    ``W[n, k] = c[n, k] * scale[n, g] + zero[n, g]``, ``c`` in [0, 15], the codes two to a byte in
    :func:`pack_int4_group_q8`'s layout. The same two-digit activations, exact integer group sums and one fixed
    float order, so the same error bound and batch invariance. Arguments, result and errors as
    :func:`int8_group_linear_q8`'s, with ``zero`` for ``minimum`` and ``codes`` from :func:`pack_int4_group_q8`.
    """
    if not kernel_available():
        raise RuntimeError("int4_group_linear_q8: llminfer's CPU kernel is not loaded "
                           f"({build.unavailable_reason() or 'unknown reason'})")
    return torch.ops.llminfer_cpu.int4_group_linear_q8(x, codes, scale, zero, out_features, bias)


def pack_int4_group_q8(q: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15], integer ``[N, K]`` (groups of 32), in :func:`int4_group_linear_q8`'s layout: uint8
    ``[ceil(N / L), L * K // 2]``, :func:`pack_int8_group_q8`'s layout with each group's 8 chunks paired, chunk
    ``j`` in the low nibbles and chunk ``j + 4`` in the high ones.

    Raises:
        RuntimeError: the kernel is not loaded.
    """
    lanes = group_q8_lanes()
    k = q.shape[1]
    chunks = pack_int8_group_q8(q.to(torch.uint8)).reshape(-1, k // 32, 8, lanes * 4)
    return (chunks[:, :, :4] | (chunks[:, :, 4:] << 4)).reshape(-1, lanes * k // 2).contiguous()


def unpack_int4_group_q8(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of :func:`pack_int4_group_q8`: int32 ``[out_features, K]``.

    Raises:
        RuntimeError: the kernel is not loaded.
    """
    lanes = group_q8_lanes()
    k = packed.shape[1] * 2 // lanes
    pairs = packed.reshape(-1, k // 32, 4, lanes * 4)
    chunks = torch.cat([pairs & 0x0F, pairs >> 4], dim=2).reshape(-1, lanes * k)
    return unpack_int8_group_q8(chunks, out_features).to(torch.int32)


# ------------------------------------------------------------------------------------ int6 codes, groups of 32
def pack_int6_group_q8(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 63], integer ``[N, K]`` (groups of 32), in ``int6_group_linear_q8``'s layout: uint8
    ``[ceil(N / L), 3 * L * K // 4]``; per block and group, the low 4 bits as :func:`pack_int4_group_q8`'s 4
    vectors (chunk ``j`` in the low nibbles, ``j + 4`` in the high ones), then 2 vectors of the top 2 bits, the
    first for chunks 0-3 and the second for chunks 4-7, chunk ``4h + c`` at bits ``2c, 2c + 1`` of each byte.

    Raises:
        RuntimeError: the kernel is not loaded.
    """
    lanes = group_q8_lanes()
    k = codes.shape[1]
    chunks = pack_int8_group_q8(codes.to(torch.uint8)).reshape(-1, k // 32, 8, lanes * 4)
    low, top = chunks & 0x0F, chunks >> 4
    nibbles = low[:, :, :4] | (low[:, :, 4:] << 4)
    planes = torch.stack([top[:, :, 4 * h] | (top[:, :, 4 * h + 1] << 2) | (top[:, :, 4 * h + 2] << 4)
                          | (top[:, :, 4 * h + 3] << 6) for h in (0, 1)], dim=2)
    return torch.cat([nibbles, planes], dim=2).reshape(-1, 3 * lanes * k // 4).contiguous()


def unpack_int6_group_q8(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of :func:`pack_int6_group_q8`: int32 ``[out_features, K]``.

    Raises:
        RuntimeError: the kernel is not loaded.
    """
    lanes = group_q8_lanes()
    k = packed.shape[1] * 4 // (3 * lanes)
    parts = packed.reshape(-1, k // 32, 6, lanes * 4)
    nibbles, planes = parts[:, :, :4], parts[:, :, 4:]
    low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)
    top = torch.stack([(planes[:, :, h] >> (2 * c)) & 0x03 for h in (0, 1) for c in range(4)], dim=2)
    return unpack_int8_group_q8((low | (top << 4)).reshape(-1, lanes * k), out_features).to(torch.int32)
