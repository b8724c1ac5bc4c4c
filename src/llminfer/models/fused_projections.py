"""One product for a decoder layer's q/k/v projections and one for its gate/up projections, on the blocked q8
weight-only kernels (int8-wo's ``int8_group_linear_q8``, int4-wo's ``int4_group_linear_q8``).

Why: at one row each projection is a separate kernel call with its own fixed cost and its own short stream of
codes from memory; one call over the concatenated codes reads the same bytes in one longer stream. The bench
model's figures are in the README's CPU section (``bench/bench_step_profile.py``).

:func:`fuse_projections` concatenates the members' codes, scales, zero points (minima) and biases along the
output channels, and makes each member's buffers views of its rows: no byte is held twice, and an in-place write
through either is seen by both, so a member module called on its own (``model(...)``, a hook, the compiled
backend) computes with what the fused product reads. In those kernels each output channel is one SIMD lane with
one fixed sequence of operations on its own codes and parameters, whatever the other channels are
(``csrc/int8_group_linear_q8.cpp``), so a channel of the fused product has the bits its member's product gives.

:class:`FusedProjection` is used by :func:`llminfer.backends.decoder_loop.forward_logits` only while its members
are still the owner's modules with the views as their codes, on the q8 path, unhooked and without a forward of
their own; anything else (a LoRA wrapper in place of a member, a buffer replaced) runs the members one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from llminfer.kernels import int8_group_linear as int8_group
from llminfer.models.weight_only import Int4WeightOnlyLinear, Int8GroupWeightOnlyLinear

__all__ = ["FUSED_ATTR", "FusedProjection", "fuse_projections"]

#: The attribute of an attention or MLP module holding its :class:`FusedProjection` (a plain attribute, not a
#: submodule or buffer: ``state_dict`` and ``named_modules`` do not see it).
FUSED_ATTR = "_llminfer_fused"

# the group of members per owner: the attention's q/k/v, the MLP's gate/up
_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class FusedProjection:
    """The concatenated product of ``members`` (q8-path :class:`Int8GroupWeightOnlyLinear` or
    :class:`Int4WeightOnlyLinear` of one class, input size and parameter dtype, each ``out_features`` a multiple
    of the kernel's lanes), whose buffers it turns into views of its own.

    Args:
        names: the members' attribute names on their owner (``("q_proj", "k_proj", "v_proj")``).
        members: the modules, in that order.
        lanes: the kernel's output channels per block (``group_q8_lanes()``).
    """

    def __init__(self, names: Sequence[str], members: Sequence[nn.Module], lanes: int) -> None:
        first = members[0]
        self.names = tuple(names)
        self.members = tuple(members)
        self.cls = type(first)
        self.in_features = first.in_features
        self.sizes = [m.out_features for m in members]
        self.out_features = sum(self.sizes)
        int8 = self.cls is Int8GroupWeightOnlyLinear
        self.op = (torch.ops.llminfer_cpu.int8_group_linear_q8 if int8
                   else torch.ops.llminfer_cpu.int4_group_linear_q8)
        self.param_names = ("scale", "minimum") if int8 else ("kernel_scales", "kernel_zeros")
        with torch.no_grad():
            self.codes = torch.cat([m.weight for m in members])
            self.scale, self.zero = (torch.cat([getattr(m, n) for m in members]) for n in self.param_names)
            self.bias = None if first.bias is None else torch.cat([m.bias.detach() for m in members])
            rows = 0
            for m, n in zip(members, self.sizes):
                blocks = slice(rows // lanes, (rows + n) // lanes)
                m.weight = self.codes[blocks]
                for name, fused in zip(self.param_names, (self.scale, self.zero)):
                    setattr(m, name, fused[blocks])
                if self.bias is not None:
                    m.bias.data = self.bias[rows:rows + n]
                rows += n
        self.views = tuple(m._buffers["weight"] for m in members)

    @staticmethod
    def eligible(members: Sequence[nn.Module], lanes: int) -> bool:
        """Whether ``members`` can share one product (see the class docstring)."""
        first = members[0]
        cls = type(first)
        if cls is Int8GroupWeightOnlyLinear:
            on_q8 = all(m.kernel_path == "q8" for m in members)
            params = ("scale", "minimum")
        elif cls is Int4WeightOnlyLinear:
            on_q8 = all(m._blocked_q8 for m in members)
            params = ("kernel_scales", "kernel_zeros")
        else:
            return False
        if not on_q8 or any(type(m) is not cls or m.in_features != first.in_features or m.out_features % lanes
                            or m.weight.device.type != "cpu" for m in members):
            return False
        dtypes = {getattr(m, p).dtype for m in members for p in params}
        biases = {None if m.bias is None else m.bias.dtype for m in members}
        return len(dtypes) == 1 and biases in ({None}, {torch.float32})

    def current(self, owner: nn.Module) -> bool:
        """Whether the product still stands for ``owner``'s members: the same modules, of the same class, with
        this product's views as their codes, unhooked, and no ``forward`` set on the instance."""
        modules = owner._modules
        for name, member, view in zip(self.names, self.members, self.views):
            if (modules.get(name) is not member or type(member) is not self.cls
                    or member._buffers.get("weight") is not view or member._forward_hooks
                    or member._forward_pre_hooks or "forward" in member.__dict__):
                return False
        return True

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The members' outputs for ``x`` (float32 ``[1, T, in_features]``, contiguous, CPU), each
        ``[1, T, out_features_i]`` float32 and contiguous, with the bits of the member's own product."""
        flat = x.view(-1, self.in_features)
        out = self.op(flat, self.codes, self.scale, self.zero, self.out_features, self.bias)
        return [part.contiguous().view(1, -1, part.shape[1]) for part in out.split(self.sizes, dim=1)]


def fuse_projections(model: nn.Module) -> int:
    """Fuse each decoder layer's q/k/v and gate/up projections of ``model`` (``model.model.layers``) where
    :meth:`FusedProjection.eligible`, in place; return how many products were fused. Idempotent; a model of
    another shape is left as it is."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not int8_group.kernel_available():
        return 0
    lanes = int8_group.group_q8_lanes()
    fused = 0
    for layer in layers:
        for owner_name, names in _GROUPS:
            owner = getattr(layer, owner_name, None)
            if not isinstance(owner, nn.Module) or FUSED_ATTR in owner.__dict__:
                continue
            members = [owner._modules.get(n) for n in names]
            if any(m is None for m in members) or not FusedProjection.eligible(members, lanes):
                continue
            owner.__dict__[FUSED_ATTR] = FusedProjection(names, members, lanes)
            fused += 1
    return fused
