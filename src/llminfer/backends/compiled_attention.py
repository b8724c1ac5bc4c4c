"""The opaque paged-attention operator that the compiled backend's graph calls.

The paged attention (:func:`llminfer.backends.attention.paged_attention_forward`) is data-dependent Python:
traced by dynamo it would specialise on every prefill segment length and recompile nearly every step. So
the compiled graph calls it through one custom operator, ``torch.ops.llminfer.paged_attention``, whose
metadata comes from a thread-local step context (:data:`step_context`) set just before the compiled call
(the design vLLM uses for its ``unified_attention`` op). See :mod:`llminfer.backends.compiled`.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from llminfer.backends.attention import METADATA_KWARG, paged_attention_forward

ATTN_OP_IMPLEMENTATION = "llminfer_paged_op"
"""Name of the op-based paged attention in ``transformers.AttentionInterface``."""

step_context = threading.local()
"""The current step's attention metadata (``meta``) and real token count (``num_tokens``), set by the
compiled backend just before it calls the compiled graph, in the thread that runs it."""


class _Layer:
    """Stands in for the attention module inside the op (the paged attention only reads ``layer_idx``)."""

    __slots__ = ("layer_idx",)

    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx


_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("llminfer::paged_attention", mutates_args=(), tags=_TAGS)
def paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                       scaling: float | None) -> torch.Tensor:
    """Paged attention of one layer for the current step (metadata from the thread's step context).

    Args:
        query: ``[1, H, T_pad, D]``; key, value: ``[1, H_kv, T_pad, D]``. Only the first ``T_real`` tokens
            (the step context's ``num_tokens``) are real; the rest is padding.
        layer_idx: the cache layer.
        scaling: softmax scale (None: ``1/sqrt(D)``).

    Returns:
        ``[1, T_pad, H, D]`` contiguous, zeros in the padded rows.

    Raises:
        RuntimeError: called outside a step (no step context in this thread).
    """
    meta = getattr(step_context, "meta", None)
    if meta is None:
        raise RuntimeError("llminfer::paged_attention called outside an llminfer step")
    n = step_context.num_tokens
    t_pad = query.shape[2]
    out, _ = paged_attention_forward(_Layer(layer_idx), query[:, :, :n], key[:, :, :n], value[:, :, :n], None,
                                     scaling=scaling, **{METADATA_KWARG: meta})
    if n == t_pad:
        return out.contiguous()
    full = query.new_zeros(1, t_pad, query.shape[1], query.shape[3])
    full[:, :n] = out
    return full


@paged_attention_op.register_fake
def _paged_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                          scaling: float | None) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def paged_attention_op_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, scaling: float | None = None,
                               dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"llminfer_paged_op"``: calls the opaque op. A step that runs
    eagerly on the compiled backend (prompt-logprob rows, a step larger than every bucket) passes its
    metadata as a keyword instead of the step context; it goes straight to the eager attention.

    Shapes as :func:`llminfer.backends.attention.paged_attention_forward` (``[1, T, H, D]`` out).
    """
    if kwargs.get(METADATA_KWARG) is not None:
        return paged_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return paged_attention_op(query, key, value, int(module.layer_idx),
                              None if scaling is None else float(scaling)), None


def register_paged_attention_op() -> str:
    """Register :func:`paged_attention_op_forward` with transformers (idempotent); return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_OP_IMPLEMENTATION, paged_attention_op_forward)
    return ATTN_OP_IMPLEMENTATION


def set_attn_implementation(model: torch.nn.Module, name: str) -> None:
    """Point the config of ``model`` and of every submodule at attention implementation ``name`` (a name
    registered with ``transformers.AttentionInterface``; layers look it up on every call)."""
    seen: set[int] = set()
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and id(cfg) not in seen and hasattr(cfg, "_attn_implementation"):
            seen.add(id(cfg))
            cfg._attn_implementation = name
