"""The eager step's forward pass without transformers' model-level wrappers, for Llama-family decoders.

A transformers ``*ForCausalLM.forward`` does more per call than llminfer's step needs: output-capture
decorators and kwargs plumbing, a causal-mask builder (the paged attention ignores the mask), a RoPE
cos/sin computation over the step's positions, and per layer the checkpointing wrapper and keyword
dispatch. At batch 1 on a small model that is a millisecond or more of Python per step.

:func:`forward_logits` runs the same submodules in the same order with the same tensor ops, so its
logits have the same bits as ``model(...)`` (``tests/test_decoder_loop.py`` checks them): the norms,
projections, MLPs and LM head are the model's own modules (kernel swaps, weight-only quantization and
LoRA wrappers included; a transformers gate/up/down MLP with a plain SiLU is computed as its forward does,
and an int8-wo or int4-wo layer on its q8 kernel path gets its op called directly, as its forward would),
attention is the function registered with ``transformers.AttentionInterface``
under llminfer's name (:data:`~llminfer.backends.attention.ATTN_IMPLEMENTATION`, the model's
``_attn_implementation`` when the loop first sees it), and the rotary helper is the model file's own ``apply_rotary_pos_emb`` (where it gives
:func:`_rotate_together`'s bits, llminfer's ``rotary_qk`` op computes those ops in one call, and each residual
sum is computed with the next RMSNorm in one op where that norm is llminfer's). Only
the RoPE cos/sin differ in how they are made: looked up in a table the model's rotary module computed
once for positions ``0..N-1``. That is exact, because each entry is one product ``position * inv_freq``
followed by elementwise ``cos``/``sin``, independent of which other positions are computed with it.

Where every layer of an int8-wo / int4-wo model is on the fastest path below, an all-decode step runs all its
layers in one C++ op instead (:mod:`llminfer.backends.decode_stack`), with the same bits.

Any model it does not recognise -- another family, a dynamic RoPE type, a wrapper class, an attention
implementation other than llminfer's -- runs through ``model(...)`` as before, and so does a step while a
forward hook sits on a module whose ``__call__`` the loop skips (the model, its decoder, a layer, an
attention module) or globally. Modules inside the layers, the embedding, the final norm and the head are
looked up at every step, so wrappers put in place later (LoRA adapters loaded at run time) are used.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from llminfer.backends.attention import (
    ATTN_IMPLEMENTATION,
    METADATA_KWARG,
    cpu_decode_attention,
    paged_attention_forward,
)
from llminfer.backends.decode_stack import DecodeStack, decode_stack_enabled
from llminfer.kernels.build import kernels_loaded
from llminfer.kernels.layers import KernelRMSNorm
from llminfer.models.fused_projections import FUSED_ATTR
from llminfer.models.weight_only import Int4WeightOnlyLinear, Int8GroupWeightOnlyLinear

__all__ = ["SUPPORTED_MODELS", "decode_stack_steps", "forward_logits", "use_decode_stack", "use_decoder_loop", "uses_decoder_loop"]

# transformers classes whose forward the loop reproduces op for op (checked against transformers 5.19 and 5.25)
SUPPORTED_MODELS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"})
# RoPE types whose inverse frequencies are fixed at load (dynamic and longrope rescale with the length)
_STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})
STACK_RETRY_STEPS = 16  # all-decode steps on the Python loop before a failed decode stack is built again
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")


class _RopeTable:
    """cos/sin of the model's rotary module for positions ``0..len-1``, ``[1, len, head_dim]`` each in the
    activation dtype, grown by doubling (on the model thread, at the first step that needs it)."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        self.rotary = rotary
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def lookup(self, positions: torch.Tensor, like: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, ``[1, T, head_dim]`` each, for ``positions`` (``[T]`` long, at most ``max_position``)."""
        if (self.cos is None or self.cos.shape[1] <= max_position or self.cos.dtype != like.dtype
                or self.cos.device != like.device):
            size = max(256, 1 << max_position.bit_length())
            ids = torch.arange(size, device=like.device)[None]
            self.cos, self.sin = self.rotary(like, ids)
        assert self.sin is not None
        return self.cos[:, positions], self.sin[:, positions]


class _Plan:
    """What the loop needs from one recognised model."""

    def __init__(self, model: torch.nn.Module) -> None:
        base = model.model
        # The layers are kept; every module inside them (and the embedding, final norm and head) is looked up
        # at each step, so LoRA wrappers put in place or taken out later (engine.load_adapter) are used.
        self.layers = list(base.layers[: model.config.num_hidden_layers])
        # The MLP's own forward is skipped where it is transformers' gate/up/down MLP with a plain SiLU, while that
        # MLP and its activation are the ones checked here, with their classes' forward functions of then:
        # (mlp, act_fn, type(mlp).forward, type(act_fn).forward) per layer, else None
        self.plain_mlp = [(layer.mlp, layer.mlp.act_fn, type(layer.mlp).forward, type(layer.mlp.act_fn).forward)
                          if type(layer.mlp).__name__ in _HF_MLPS and _defined_in_model_file(type(layer.mlp))
                          and _is_silu(getattr(layer.mlp, "act_fn", None))
                          and all(hasattr(layer.mlp, p) for p in _MLP_PARTS) else None for layer in self.layers]
        # Not the model itself: the plan is the value of a weak-keyed map whose key is the model, and a reference
        # to it here would keep both alive for the life of the process (see _hooked's caller).
        self.hookable = [base, *self.layers, *(layer.self_attn for layer in self.layers),
                         *(m for layer in self.layers for m in (layer.mlp, getattr(layer.mlp, "act_fn", None))
                           if isinstance(m, torch.nn.Module))]
        self.rope = _RopeTable(base.rotary_emb)
        self.rotate = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.plain_rotate = _same_rotation(self.rotate)
        # Qwen2 and Mistral pass their window to the attention function (llminfer's paged attention ignores it)
        self.extra = [{"sliding_window": getattr(layer.self_attn, "sliding_window", None)}
                      if type(model).__name__ != "LlamaForCausalLM" else {} for layer in self.layers]
        self.stack_on = decode_stack_enabled()
        self.stack: DecodeStack | None = None
        self.stack_retry_in = 0  # decode steps before building the stack is tried again
        self.stack_steps = 0  # steps the stack ran

    def decode_stack(self, meta: Any) -> DecodeStack | None:
        """The :class:`DecodeStack` for an all-decode step on a float32 cache where it applies, else None. Where
        a layer is off its path (a LoRA wrapper in place, a hook), building it is tried again after
        :data:`STACK_RETRY_STEPS` such steps (a failed try stops at the first layer off the path)."""
        group = meta.decode
        if (not self.stack_on or not meta.all_decode or group is None or group.ctx_lens is None
                or meta.triton is not None or meta.cache.k[0].dtype != torch.float32
                or torch.compiler.is_compiling()):
            return None
        if self.stack is None or not self.stack.current():
            if self.stack is None and self.stack_retry_in > 0:
                self.stack_retry_in -= 1
                return None
            self.stack = DecodeStack.build(self.layers, self.plain_mlp)
            if self.stack is None:
                self.stack_retry_in = STACK_RETRY_STEPS
                return None
        self.stack_steps += 1
        return self.stack


def _norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; where ``module`` is the model file's own RMSNorm in float32 (and not hooked),
    ``torch.nn.functional.rms_norm`` with its weight and epsilon instead: the same bits in float32 (not in
    bf16/fp16, where transformers rounds before the weight product), in one call instead of six; where it is
    llminfer's :class:`~llminfer.kernels.layers.KernelRMSNorm` on float32 input (and not hooked), its op
    without the module call."""
    if type(module) is KernelRMSNorm:
        if _kernel_norm_takes(module, x):
            return torch.ops.llminfer_cpu.rms_norm(x, module.weight, module.variance_epsilon)
        return module(x)
    if x.dtype == torch.float32 and type(module).__name__ in _HF_RMS_NORMS:
        weight, eps = module.weight, getattr(module, "variance_epsilon", None)
        if (weight.dtype == torch.float32 and weight.dim() == 1 and isinstance(eps, float)
                and not (module._forward_hooks or module._forward_pre_hooks)):
            return torch.nn.functional.rms_norm(x, (weight.shape[0],), weight, eps)
    return module(x)


def _kernel_norm_takes(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether llminfer's RMSNorm ops may replace ``module(x)``: llminfer's :class:`KernelRMSNorm` with a
    float32 weight, not hooked, on float32 CPU input."""
    return (type(module) is KernelRMSNorm and x.dtype == torch.float32 and x.device.type == "cpu"
            and module.weight.dtype == torch.float32 and not (module._forward_hooks or module._forward_pre_hooks))


def _add_norm(module: torch.nn.Module, hidden: torch.Tensor,
              delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden + delta, module(hidden + delta))`` (``delta`` None: nothing added), for a residual
    connection followed by the next norm. Where :func:`_norm` would call llminfer's RMSNorm op, both in one
    op (``add_rms_norm``), with the same bits."""
    if delta is None:
        return hidden, _norm(module, hidden)
    if (_kernel_norm_takes(module, hidden) and delta.dtype == torch.float32 and delta.is_cpu
            and hidden.shape == delta.shape):
        return torch.ops.llminfer_cpu.add_rms_norm(hidden, delta, module.weight, module.variance_epsilon)
    hidden = hidden + delta
    return hidden, _norm(module, hidden)


def _rotate_together(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``, the same elementwise ops)
    on q and k as one tensor: half the op calls. ``q``: ``[1, H, T, D]``, ``k``: ``[1, H_kv, T, D]``."""
    heads, half = q.shape[1], q.shape[-1] // 2
    qk = torch.cat((q, k), dim=1)
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    out = qk * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    return out[:, :heads], out[:, heads:]


def _rotate_in_kernel(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_rotate_together`'s operations in one op (``csrc/rotary_embedding.cpp``, the same bits) for
    float32 CPU tensors; anything else goes to :func:`_rotate_together`."""
    if q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32 and q.is_cpu:
        return torch.ops.llminfer_cpu.rotary_qk(q, k, cos, sin)
    return _rotate_together(q, k, cos, sin)


def _same_rotation(rotate: Any) -> bool:
    """Whether the model file's ``apply_rotary_pos_emb`` gives :func:`_rotate_together`'s bits (it does unless
    a hub kernel replaced it), tried once on small random tensors of a private generator."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 3, 16, generator=gen), torch.randn(1, 2, 3, 16, generator=gen)
    cos, sin = torch.randn(1, 3, 16, generator=gen), torch.randn(1, 3, 16, generator=gen)
    try:
        with torch.inference_mode():
            return all(torch.equal(a, b) for a, b in zip(rotate(q, k, cos, sin), _rotate_together(q, k, cos, sin)))
    except Exception:  # noqa: BLE001 - another signature: call the model's own
        return False


_HF_RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"})
_HF_MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "MistralMLP"})  # down_proj(act_fn(gate_proj(x)) * up_proj(x))
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


def _defined_in_model_file(cls: type) -> bool:
    """Whether ``cls.forward`` is the one its model file defines (not a function patched onto the class)."""
    forward = getattr(cls, "forward", None)
    return (getattr(forward, "__module__", None) == cls.__module__
            and getattr(forward, "__qualname__", None) == f"{cls.__qualname__}.forward")


def _is_silu(act: Any) -> bool:
    """Whether ``act`` computes ``torch.nn.functional.silu``'s bits (transformers' ``SiLUActivation`` or
    ``nn.SiLU``, unless a hub kernel replaced its forward), tried once on a small random tensor."""
    if not isinstance(act, torch.nn.Module):
        return False
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(0))
    try:
        with torch.inference_mode():
            return torch.equal(act(x), torch.nn.functional.silu(x))
    except Exception:  # noqa: BLE001 - not an activation of one tensor
        return False


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for ``x`` ``[1, T, K]``. Where ``module`` is an int8-wo or int4-wo layer on its q8 kernel
    path (not hooked) and ``x`` a contiguous float32 CPU tensor, the op its forward would call, on the same
    arguments, without the module call and its buffer lookups (about 8 us a layer at one row)."""
    cls = type(module)
    if (cls is Int8GroupWeightOnlyLinear or cls is Int4WeightOnlyLinear) and module.kernel_path == "q8" \
            and x.dtype == torch.float32 and x.is_cpu and x.is_contiguous() \
            and not (module._forward_hooks or module._forward_pre_hooks) \
            and "forward" not in module.__dict__:  # no forward replaced on the instance (a patch, accelerate)
        buffers, bias = module._buffers, module._parameters.get("bias")
        if bias is None or bias.dtype == torch.float32:
            flat = x.view(-1, x.shape[-1])
            if cls is Int8GroupWeightOnlyLinear:
                out = torch.ops.llminfer_cpu.int8_group_linear_q8(
                    flat, buffers["weight"], buffers["scale"], buffers["minimum"], module.out_features, bias)
                return out.view(1, -1, module.out_features)
            if module._blocked_q8:
                out = torch.ops.llminfer_cpu.int4_group_linear_q8(
                    flat, buffers["weight"], buffers["kernel_scales"], buffers["kernel_zeros"], module.out_features,
                    bias)
                return out.view(1, -1, module.out_features)
    return module(x)


def _fused(owner: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor] | None:
    """The outputs of ``owner``'s fused projections (:mod:`llminfer.models.fused_projections`: q/k/v or gate/up in
    one product, the bits of each member's own) for ``x`` ``[1, T, K]``, or None where ``owner`` has none, it
    no longer stands for the members, or ``x`` is not a contiguous float32 CPU tensor."""
    fused = owner.__dict__.get(FUSED_ATTR)
    if (fused is None or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous()
            or not fused.current(owner)):
        return None
    return fused(x)


_plans: weakref.WeakKeyDictionary[torch.nn.Module, _Plan | None] = weakref.WeakKeyDictionary()


def _plan_for(model: torch.nn.Module) -> _Plan | None:
    try:
        return _plans[model]
    except KeyError:
        pass
    plan = _Plan(model) if _recognised(model) else None
    _plans[model] = plan
    return plan


def _recognised(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    base = getattr(model, "model", None)
    if type(model).__name__ not in SUPPORTED_MODELS or config is None or base is None or model.training:
        return False
    if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return False
    rotary = getattr(base, "rotary_emb", None)
    if getattr(rotary, "rope_type", None) not in _STATIC_ROPE:
        return False
    layers = getattr(base, "layers", ())
    if len(layers) < config.num_hidden_layers or not all(
            all(hasattr(layer, p) for p in _LAYER_PARTS) and all(hasattr(layer.self_attn, p) for p in _ATTN_PARTS)
            for layer in layers):
        return False
    module = sys.modules.get(type(layers[0].self_attn).__module__)
    return hasattr(module, "apply_rotary_pos_emb") and all(hasattr(base, p) for p in ("embed_tokens", "norm"))


def uses_decoder_loop(model: torch.nn.Module) -> bool:
    """True when :func:`forward_logits` runs ``model`` through the loop rather than ``model(...)``."""
    return _plan_for(model) is not None


def use_decoder_loop(model: torch.nn.Module, on: bool) -> bool:
    """Switch the loop on (where ``model`` is recognised) or off (``model(...)`` always), for side-by-side
    measurements; return whether it was in use before. Call it where the steps run (the engine's model
    thread) or while none runs. Raises nothing."""
    was = uses_decoder_loop(model)
    _plans[model] = _Plan(model) if on and _recognised(model) else None
    return was


def decode_stack_steps(model: torch.nn.Module) -> int:
    """How many steps of ``model`` the decode stack has run (0 where the model does not run through the loop)."""
    plan = _plans.get(model)
    return plan.stack_steps if plan is not None else 0


def use_decode_stack(model: torch.nn.Module, on: bool) -> bool:
    """Let the loop take the decode stack (:mod:`llminfer.backends.decode_stack`) for ``model``'s all-decode steps
    where it applies, or not, for side-by-side measurements; return the previous setting (False where the model
    does not run through the loop). Call it where the steps run or while none runs. Raises nothing."""
    plan = _plan_for(model)
    if plan is None:
        return False
    was, plan.stack_on = plan.stack_on, on
    return was


def forward_logits(model: torch.nn.Module, ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor,
                   meta: Any, max_position: int) -> torch.Tensor:
    """The model's logits at the kept rows of one packed step, with the same bits as ``model(...).logits``.

    Args:
        ids: ``[1, T]`` long token ids.
        position_ids: ``[1, T]`` long positions.
        keep: ``[K]`` long row indices into the packed row.
        meta: the step's :class:`~llminfer.backends.attention_metadata.PagedAttentionMetadata`.
        max_position: the largest value in ``position_ids`` (known to the caller without a device sync).

    Returns:
        ``[1, K, V]`` logits in the model's dtype.

    Raises:
        Exception: whatever the model's modules or the attention function raise (the step backend turns it
            into the step's error).
    """
    plan = _plan_for(model)
    if plan is None or model._forward_hooks or model._forward_pre_hooks or _hooked(plan):
        return model(input_ids=ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep,
                     **{METADATA_KWARG: meta}).logits
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]
    direct_attention = attention is paged_attention_forward  # not a wrapper registered in its place
    base = model.model
    hidden = base.embed_tokens(ids)
    cos, sin = plan.rope.lookup(position_ids[0], hidden, max_position)
    shape = (1, ids.shape[1], -1)
    rotate = _rotate_together if plan.plain_rotate else plan.rotate
    if plan.plain_rotate and hidden.dtype == torch.float32 and hidden.is_cpu and kernels_loaded():
        rotate = _rotate_in_kernel
    stack = plan.decode_stack(meta) if rotate is _rotate_in_kernel and direct_attention else None
    if stack is not None:
        hidden, x = _add_norm(base.norm, *stack(hidden, cos, sin, meta))
        return _linear(model.lm_head, x[:, keep])
    delta = None  # the last residual branch's output, added to ``hidden`` together with the next norm
    for layer, extra, plain_mlp in zip(plan.layers, plan.extra, plan.plain_mlp):
        attn = layer.self_attn
        hidden, x = _add_norm(layer.input_layernorm, hidden, delta)
        heads = (1, ids.shape[1], -1, attn.head_dim)
        qkv = _fused(attn, x)
        if qkv is None:
            qkv = (_linear(attn.q_proj, x), _linear(attn.k_proj, x), _linear(attn.v_proj, x))
        q, k, v = (t.view(heads).transpose(1, 2) for t in qkv)
        q, k = rotate(q, k, cos, sin)
        out = cpu_decode_attention(attn.layer_idx, q, k, v, meta, attn.scaling) if direct_attention else None
        if out is None:
            out, _ = attention(attn, q, k, v, None, dropout=0.0, scaling=attn.scaling, **extra,
                               **{METADATA_KWARG: meta})
        hidden, x = _add_norm(layer.post_attention_layernorm, hidden, _linear(attn.o_proj, out.reshape(shape).contiguous()))
        mlp = layer.mlp
        if plain_mlp is not None and mlp is plain_mlp[0] and mlp.act_fn is plain_mlp[1] \
                and type(mlp).forward is plain_mlp[2] and type(mlp.act_fn).forward is plain_mlp[3] \
                and "forward" not in mlp.__dict__ and "forward" not in plain_mlp[1].__dict__:
            gate_up = _fused(mlp, x)
            gate, up = gate_up if gate_up is not None else (_linear(mlp.gate_proj, x), _linear(mlp.up_proj, x))
            delta = _linear(mlp.down_proj, torch.nn.functional.silu(gate) * up)
        else:
            delta = layer.mlp(x)
    hidden, x = _add_norm(base.norm, hidden, delta)
    return _linear(model.lm_head, x[:, keep])


def _hooked(plan: _Plan) -> bool:
    """Whether a forward hook sits where the loop does not call ``__call__`` (the model's decoder, a layer, an
    attention module; the model's own hooks are checked by the caller) or is global: then ``model(...)`` runs,
    so the hook does."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for m in plan.hookable)
