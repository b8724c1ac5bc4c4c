"""Checks of the offline benchmark settings, importable without torch or polars (the CLI checks its flags
with them before anything heavy loads)."""

from __future__ import annotations

from collections.abc import Sequence


def check_settings(batch_sizes: Sequence[int], num_runs: int, max_new_tokens: int, warmup: int,
                   prompt_len: int | None) -> None:
    """Check benchmark settings (``prompt_len`` None: fixed prompts are given).

    Raises:
        ValueError: empty ``batch_sizes``, a non-positive size / count / length, or a negative warm-up.
    """
    if not batch_sizes or any(b <= 0 for b in batch_sizes):
        raise ValueError("batch sizes must be positive integers")
    if num_runs <= 0:
        raise ValueError(f"runs must be >= 1, got {num_runs}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if prompt_len is not None and prompt_len <= 0:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
