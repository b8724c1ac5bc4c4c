"""All decoder layers of an all-decode step in one C++ call (``csrc/decode_layers.cpp``), where the eager decoder
loop's fastest path applies to every layer.

Why: at one row, :func:`llminfer.backends.decoder_loop.forward_logits` spends a good part of the step in Python
between its ops -- the module lookups and checks that keep it exact for hooks, LoRA wrappers and other
replacements, and about 15 op calls a layer. :class:`DecodeStack` gathers the layers' tensors and sizes once, and
each step checks in one pass that every module, buffer and forward function it took is still the one in place
(a hook, a wrapper, a replaced buffer or a patched forward sends the step back to the Python loop). The op calls
the functions the Python loop calls on that path, with the same arguments in the same order, so the logits have
the same bits (``tests/test_decode_stack.py``).

The path: per layer llminfer's RMSNorm ops (:class:`~llminfer.kernels.layers.KernelRMSNorm`), q/k/v and gate/up
fused on the q8 kernels (:mod:`llminfer.models.fused_projections`), o and down projections on the q8 kernels
(int8-wo's or int4-wo's), the plain rotation and SiLU MLP, and llminfer's paged decode attention on a float32
cache. ``LLMINFER_DECODE_STACK=0`` turns it off (the Python loop then runs every step).
"""

from __future__ import annotations

from typing import Any

import torch

from llminfer.env import env_flag
from llminfer.kernels.layers import KernelRMSNorm
from llminfer.models.fused_projections import FUSED_ATTR
from llminfer.models.weight_only import Int4WeightOnlyLinear, Int8GroupWeightOnlyLinear

__all__ = ["DecodeStack", "decode_stack_enabled"]

_CODE_BITS = {Int8GroupWeightOnlyLinear: 8, Int4WeightOnlyLinear: 4}
_PARAM_BUFFERS = {8: ("weight", "scale", "minimum"), 4: ("weight", "kernel_scales", "kernel_zeros")}


def decode_stack_enabled() -> bool:
    """Whether ``$LLMINFER_DECODE_STACK`` leaves the stack on (anything but ``0``, ``false``, ``off``, ``no``)."""
    return env_flag("LLMINFER_DECODE_STACK")


def _q8_bits(module: torch.nn.Module) -> int | None:
    """8 or 4 where ``module`` is an int8-wo or int4-wo linear on its q8 kernel path, unhooked and without a forward
    of its own, with no bias or a float32 one; else None."""
    bits = _CODE_BITS.get(type(module))  # type: ignore[call-overload]
    if bits is None or module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__:
        return None
    on_q8 = module.kernel_path == "q8" if bits == 8 else module._blocked_q8
    bias = module._parameters.get("bias")
    return bits if on_q8 and (bias is None or bias.dtype == torch.float32) else None


def _plain_norm(module: torch.nn.Module) -> bool:
    weight = module._parameters.get("weight") if type(module) is KernelRMSNorm else None
    return (weight is not None and weight.dtype == torch.float32 and weight.dim() == 1 and weight.is_cpu
            and isinstance(module.variance_epsilon, float) and not (module._forward_hooks or module._forward_pre_hooks))


class DecodeStack:
    """The tensors, sizes and checks of ``decode_layers_q8`` for a model's decoder layers.

    Args:
        layers: the decoder layers, in order.
        plain_mlp: per layer, the decoder loop's ``_Plan.plain_mlp`` entry (None: the MLP is not the plain
            gate/up/down with SiLU).

    Use :meth:`build` (None where a layer is not on the path) and call :meth:`current` before each use.
    """

    def __init__(self, layers: list[torch.nn.Module], plain_mlp: list[Any]) -> None:
        self.params: list[torch.Tensor] = []
        self.biases: list[torch.Tensor | None] = []
        self.ints: list[int] = []
        self.floats: list[float] = []
        # (mapping, key, object) that must still be in place: a module in its parent, a buffer or parameter in
        # its module, a fused product in its owner
        self._same: list[tuple[dict[str, Any], str, Any]] = []
        self._projections: list[tuple[torch.nn.Module, int]] = []  # each must keep its q8 bits
        # (object, attribute, value) the op was given as a number: the scale, epsilons, sizes and cache layer
        self._values: list[tuple[Any, str, Any]] = []
        self._norms: list[torch.nn.Module] = []
        self._mlps: list[tuple[Any, ...]] = []
        self._fused: list[tuple[Any, torch.nn.Module]] = []  # (FusedProjection, its owner)
        for layer, mlp_entry in zip(layers, plain_mlp):
            self._add_layer(layer, mlp_entry)

    @classmethod
    def build(cls, layers: list[torch.nn.Module], plain_mlp: list[Any]) -> DecodeStack | None:
        """The stack of ``layers``, or None where any layer is off the path (see the module docstring)."""
        try:
            stack = cls(layers, plain_mlp)
        except _OffPath:
            return None
        return stack if stack.current() else None

    def _add_layer(self, layer: torch.nn.Module, mlp_entry: Any) -> None:
        attn, mlp = layer._modules.get("self_attn"), layer._modules.get("mlp")
        norms = (layer._modules.get("input_layernorm"), layer._modules.get("post_attention_layernorm"))
        qkv = attn.__dict__.get(FUSED_ATTR) if attn is not None else None
        gate_up = mlp.__dict__.get(FUSED_ATTR) if mlp is not None else None
        if (qkv is None or gate_up is None or mlp_entry is None or mlp_entry[0] is not mlp
                or mlp_entry[1] is not mlp._modules.get("act_fn")
                or not all(isinstance(n, torch.nn.Module) and _plain_norm(n) for n in norms)
                or not qkv.current(attn) or not gate_up.current(mlp)):
            raise _OffPath
        o_proj, down = attn._modules.get("o_proj"), mlp._modules.get("down_proj")
        o_bits, down_bits = _q8_bits(o_proj), _q8_bits(down)
        fused_bits = {_CODE_BITS[qkv.cls], _CODE_BITS[gate_up.cls]}  # type: ignore[index]
        q_size, k_size, v_size = (qkv.sizes + [0, 0])[:3]
        head_dim, scaling = attn.head_dim, attn.scaling
        if (o_bits is None or down_bits is None or len(qkv.sizes) != 3 or k_size != v_size or len(gate_up.sizes) != 2
                or gate_up.sizes[0] != gate_up.sizes[1] or head_dim % 8 or not isinstance(scaling, float)
                or o_proj.out_features != down.out_features or not fused_bits <= {4, 8}):
            raise _OffPath
        for parent, names in ((layer, ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")),
                              (attn, ("o_proj",)), (mlp, ("down_proj", "act_fn"))):
            self._same += [(parent._modules, name, parent._modules.get(name)) for name in names]
        self._same += [(attn.__dict__, FUSED_ATTR, qkv), (mlp.__dict__, FUSED_ATTR, gate_up)]
        self._same += [(n._parameters, "weight", n._parameters["weight"]) for n in norms]
        for module, bits in ((o_proj, o_bits), (down, down_bits)):
            self._same += [(module._buffers, name, module._buffers[name]) for name in _PARAM_BUFFERS[bits]]
            self._same.append((module._parameters, "bias", module._parameters.get("bias")))
            self._projections.append((module, bits))
        self._values += [(attn, "scaling", scaling), (attn, "head_dim", head_dim), (attn, "layer_idx", attn.layer_idx),
                         (o_proj, "out_features", o_proj.out_features), (down, "out_features", down.out_features),
                         *((n, "variance_epsilon", n.variance_epsilon) for n in norms)]
        self._norms += norms
        self._mlps.append(mlp_entry)
        self._fused += [(qkv, attn), (gate_up, mlp)]
        o_params = [o_proj._buffers[n] for n in _PARAM_BUFFERS[o_bits]]
        down_params = [down._buffers[n] for n in _PARAM_BUFFERS[down_bits]]
        self.params += [norms[0].weight, qkv.codes, qkv.scale, qkv.zero, *o_params, norms[1].weight,
                        gate_up.codes, gate_up.scale, gate_up.zero, *down_params]
        self.biases += [qkv.bias, o_proj._parameters.get("bias"), gate_up.bias, down._parameters.get("bias")]
        self.ints += [attn.layer_idx, head_dim, q_size, k_size, o_proj.out_features, gate_up.sizes[0],
                      down.out_features, _CODE_BITS[qkv.cls], o_bits, _CODE_BITS[gate_up.cls], down_bits]
        self.floats += [norms[0].variance_epsilon, norms[1].variance_epsilon, scaling]

    def current(self) -> bool:
        """Whether every module, buffer, product, number and forward function taken at :meth:`build` is still in
        place and on the path (one pass, a few microseconds a layer)."""
        return (all(mapping.get(key) is obj for mapping, key, obj in self._same)
                and all(getattr(obj, name, None) == value for obj, name, value in self._values)
                and all(_q8_bits(module) == bits for module, bits in self._projections)
                and all(_plain_norm(n) for n in self._norms)
                and all(fused.current(owner) for fused, owner in self._fused)
                and all(type(mlp).forward is mlp_forward and type(act).forward is act_forward
                        and "forward" not in mlp.__dict__ and "forward" not in act.__dict__
                        and not (mlp._forward_hooks or mlp._forward_pre_hooks)
                        for mlp, act, mlp_forward, act_forward in self._mlps))

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, delta)``, ``[1, T, D]`` float32 each, after the last layer (not yet added), for an all-decode
        step: ``hidden`` the embeddings ``[1, T, D]`` float32, ``cos``/``sin`` ``[1, T, head_dim]``, ``meta`` the
        step's :class:`~llminfer.backends.attention_metadata.PagedAttentionMetadata` with a float32 cache.

        Raises:
            RuntimeError: from the op, where its arguments disagree (a bug, not a user error)."""
        group = meta.decode
        return torch.ops.llminfer_cpu.decode_layers_q8(
            hidden, cos, sin, self.params, self.biases, self.ints, self.floats, meta.cache.k, meta.cache.v,
            meta.slot_mapping, group.block_ids.view(len(group.index), -1), group.ctx_lens)


class _OffPath(Exception):
    """A layer is not on the stack's path."""
