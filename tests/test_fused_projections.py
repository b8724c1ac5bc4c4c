"""q/k/v and gate/up of the q8 weight-only layers in one product each (llminfer.models.fused_projections): the
members' bits, shared bytes, and the member-by-member path wherever the fused product no longer stands."""

from __future__ import annotations

import pytest
import torch
from test_decoder_loop import _cache, _model, _prefill_then_step, _step

from llminfer.backends import decoder_loop
from llminfer.kernels.build import skinny_linear_available
from llminfer.models.fused_projections import FUSED_ATTR, FusedProjection, fuse_projections

pytestmark = pytest.mark.skipif(not skinny_linear_available(), reason="llminfer's CPU kernel does not build here")


def _quantized(family: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    from llminfer.models.kernel_swap import enable_cpu_kernels
    from llminfer.models.weight_only import quantize_model

    monkeypatch.setenv("LLMINFER_CPU_KERNEL_INT8_PATH", "q8")
    monkeypatch.setenv("LLMINFER_CPU_KERNEL_INT4_PATH", "q8")
    model = _model(family)
    quantize_model(model, mode, compute_dtype=torch.float32)
    enable_cpu_kernels(model)  # fuses
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v with a bias
@pytest.mark.parametrize("mode", ["int8-wo", "int4-wo"])
def test_a_fused_product_gives_each_member_its_own_bits_from_shared_bytes(mode, family, monkeypatch):
    model = _quantized(family, mode, monkeypatch)
    for layer in model.model.layers:
        for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            fused = owner.__dict__[FUSED_ATTR]
            assert fused.current(owner)
            members = [getattr(owner, n) for n in names]
            start, end = fused.codes.data_ptr(), fused.codes.data_ptr() + fused.codes.nbytes
            assert all(start <= m.weight.data_ptr() < end for m in members)  # views, no second copy
            for rows in (1, 3, 33):
                x = torch.randn(1, rows, members[0].in_features, generator=torch.Generator().manual_seed(rows))
                with torch.inference_mode():
                    outs = fused(x)
                    for m, out in zip(members, outs):
                        assert torch.equal(out, m(x))
    assert fuse_projections(model) == 0  # idempotent


@pytest.mark.parametrize("mode", ["int8-wo", "int4-wo"])
def test_the_loop_takes_the_fused_products_and_keeps_the_model_forwards_bits(mode, monkeypatch):
    model = _quantized("qwen2", mode, monkeypatch)
    calls = []
    monkeypatch.setattr(FusedProjection, "__call__",
                        lambda self, x, _f=FusedProjection.__call__: calls.append(1) or _f(self, x))
    for tokens, starts in (([[5, 6, 7]], [0]), ([[1], [2, 3]], [40, 7])):
        assert torch.equal(_prefill_then_step(model, tokens, starts, loop=True),
                           _prefill_then_step(model, tokens, starts, loop=False))
    layers = model.config.num_hidden_layers
    calls.clear()
    _step(model, _cache(model, 1), [[3]], [0], loop=True)
    assert len(calls) == 2 * layers


@pytest.mark.parametrize("change", ["wrapped", "hooked", "buffer replaced"])
def test_a_member_changed_after_fusion_runs_member_by_member(change, monkeypatch):
    model = _quantized("llama", "int8-wo", monkeypatch)
    attn = model.model.layers[0].self_attn
    fused = attn.__dict__[FUSED_ATTR]
    if change == "wrapped":  # what an adapter does: another module in the member's place, doubling its output

        class Doubled(torch.nn.Module):
            def __init__(self, inner: torch.nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return 2 * self.inner(x)

        attn.k_proj = Doubled(attn.k_proj)
    elif change == "hooked":
        attn.v_proj.register_forward_hook(lambda module, args, out: out * 0.5)
    else:
        attn.q_proj.weight = attn.q_proj.weight.clone()
    assert not fused.current(attn)
    assert torch.equal(_prefill_then_step(model, [[5, 6, 7]], [0], loop=True),
                       _prefill_then_step(model, [[5, 6, 7]], [0], loop=False))


def test_an_in_place_edit_of_a_member_is_what_the_fused_product_reads(monkeypatch):
    model = _quantized("qwen2", "int4-wo", monkeypatch)
    mlp, attn = model.model.layers[1].mlp, model.model.layers[1].self_attn
    x = torch.randn(1, 2, mlp.up_proj.in_features)
    with torch.no_grad():  # through the members: the fused products' bytes
        mlp.up_proj.kernel_scales.mul_(2)
        attn.k_proj.bias.add_(1.0)
    with torch.inference_mode():
        assert torch.equal(mlp.__dict__[FUSED_ATTR](x)[1], mlp.up_proj(x))
        assert torch.equal(attn.__dict__[FUSED_ATTR](x)[1], attn.k_proj(x))
    assert decoder_loop.uses_decoder_loop(model)
