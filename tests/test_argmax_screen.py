"""The argmax screen: bf16 and int8 copies of an fp32 head that must give each greedy row the fp32 head's argmax."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from helpers import make_engine
from llminfer.kernels.argmax_screen import (
    ArgmaxScreen,
    ScreenProduct,
    attach_argmax_screen,
    int8_a8_available,
    int8_a8_screen,
    int8_screen,
    int8_screens,
    screen_margin,
)
from llminfer.kernels.bf16_linear import bf16_linear
from llminfer.kernels.build import bf16_kernel_available, skinny_linear_available
from llminfer.kernels.prepack import PrepackedLinear, argmax_only, prepack_supported
from llminfer.models import builtin_model_path

needs_kernels = pytest.mark.skipif(not skinny_linear_available(), reason="llminfer's CPU kernels are not built here")
needs_bf16_kernel = pytest.mark.skipif(not (skinny_linear_available() and bf16_kernel_available()),
                                       reason="llminfer's bf16 kernel (AVX-512 BF16) does not run here")
needs_a_copy = pytest.mark.skipif(
    not (skinny_linear_available() or prepack_supported(torch.bfloat16, torch.device("cpu"))),
    reason="neither llminfer's int8 kernel nor oneDNN's bf16 matmul runs here")


def _bf16_matmul(weight: torch.Tensor):
    """The bf16 screen's arithmetic: bf16 operands, fp32 sums, the result rounded to bf16."""
    copy = weight.to(torch.bfloat16).float()
    return lambda x: (x.to(torch.bfloat16).float() @ copy.T).to(torch.bfloat16)


def _bf16_reference(weight: torch.Tensor) -> ArgmaxScreen:
    """A screen with bf16_screen's bound on :func:`_bf16_matmul` (any CPU)."""
    margin = screen_margin(weight.shape[1]) * float(weight.norm(dim=1).max())
    product = ScreenProduct("bf16", _bf16_matmul(weight), lambda x: x.norm(dim=1, keepdim=True) * margin, 0)
    return ArgmaxScreen(weight, [(0, product)])


def _screens(weight: torch.Tensor) -> list[ArgmaxScreen]:
    screens = [_bf16_reference(weight)]
    if skinny_linear_available() and weight.shape[1] % 32 == 0:
        screens.append(ArgmaxScreen(weight, [(0, int8_screen(weight))]))
    if int8_a8_available(weight.shape[1]):
        screens.append(ArgmaxScreen(weight, [(0, int8_a8_screen(weight))]))
    return screens


def _fp32_scores(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The screen's own fp32 score of every token: the kernel's candidate scoring with every token a candidate
    where the kernels are loaded, else the torch sum the screen uses there."""
    if skinny_linear_available() and weight.shape[1] % 8 == 0:
        scores = torch.zeros(x.shape[0], weight.shape[0])
        threshold = torch.full((x.shape[0],), -math.inf)
        torch.ops.llminfer_cpu.screen_candidates(scores, threshold, weight.contiguous(), x.contiguous(), weight.shape[0])
        return scores
    return torch.stack([(weight * row).sum(dim=1) for row in x])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 6), vocab=st.integers(2, 400),
       d=st.sampled_from([8, 64, 96, 512]), ties=st.integers(0, 5), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_screen_keeps_the_fp32_argmax(seed, rows, vocab, d, ties, scale):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, d, generator=gen) * 0.05
    x = torch.randn(rows, d, generator=gen) * scale
    # near-ties that bf16 cannot tell apart: copies of the current winner moved by a few fp32 ulps
    top = int(_fp32_scores(weight, x)[0].argmax())
    for k in range(min(ties, vocab - 1)):
        j = (top + 1 + k) % vocab
        weight[j] = weight[top]
        weight[j, k % d] += (k - 2) * 1e-6
    exact = _fp32_scores(weight, x)
    for screen in _screens(weight):
        with torch.inference_mode():
            out = screen.logits(x)
        assert out is not None
        assert out.argmax(dim=1).tolist() == exact.argmax(dim=1).tolist()
        best = out.max(dim=1, keepdim=True).values
        assert bool((torch.eq(out, exact) | (out < best)).all())  # the best carry their fp32 scores


@pytest.mark.parametrize("d", [64, 512, 2048])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_screen_order_flipped_by_bf16_rounding(d, scale):
    """Token 2 wins in fp32 and loses after bf16 rounding: against an alternating +-1 row, its weights 1 + 2^-9
    (every other one) round to 1 and its logit to 0, while token 1's one weight 1 + 2^-7 is exact. Only the
    error bound keeps token 2 among the candidates."""
    weight = torch.ones(3, d)
    weight[0] = 0.5
    weight[1, 0] = 1 + 2.0**-7
    weight[2, 0::2] = 1 + 2.0**-9
    x = torch.ones(1, d) * scale
    x[0, 1::2] = -scale
    with torch.inference_mode():
        assert int(_bf16_matmul(weight)(x).float().argmax()) == 1
        assert int(_bf16_reference(weight).logits(x).argmax()) == int(_fp32_scores(weight, x).argmax()) == 2


@needs_kernels
@pytest.mark.parametrize("d", [64, 512])
def test_screen_order_flipped_by_int8_rounding(d):
    """Token 2 wins in fp32 and loses in int8: its first weight sets a scale of 1, so its 0.4s round to 0,
    while token 1's weights are exact codes."""
    weight = torch.zeros(3, d)
    weight[:, 0] = 127.0
    weight[1, 2] = 1.0
    weight[2, 2::2] = 0.4
    x = torch.ones(1, d)
    x[0, 1::2] = -1.0
    product = int8_screen(weight)
    with torch.inference_mode():
        assert int(product.product(x).argmax()) == 1
        assert int(ArgmaxScreen(weight, [(0, product)]).logits(x).argmax()) == int(_fp32_scores(weight, x).argmax()) == 2


needs_a8 = pytest.mark.skipif(not int8_a8_available(64), reason="int8_linear_a8 needs the AVX-512 VNNI kernel build")


@needs_a8
@pytest.mark.parametrize("d", [64, 512])
def test_screen_order_flipped_by_8_bit_activations(d):
    """Token 2 wins in fp32 and loses on 8-bit activations: x's first element sets the row's step to 1, so
    its 0.4s round to 0, while token 1's one activation is exact."""
    weight = torch.zeros(3, d)
    weight[:, 0] = 127.0
    weight[1, 1] = 1.0
    weight[2, 2::2] = 1.0
    x = torch.full((1, d), 0.4)
    x[0, 0], x[0, 1] = 127.0, 1.0
    product = int8_a8_screen(weight)
    with torch.inference_mode():
        assert int(product.product(x).argmax()) == 1
        assert int(ArgmaxScreen(weight, [(0, product)]).logits(x).argmax()) == int(_fp32_scores(weight, x).argmax()) == 2


def _a8_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8_linear_a8's arithmetic in torch: rows rounded to max|x| / 127 steps, exact integer dots,
    float32(dot) * sx * scale."""
    sx = x.abs().amax(dim=1, keepdim=True) / 127
    q = torch.round(x / sx).clamp(-127, 127)
    dot = (q.double() @ codes.double().T).float()
    return dot * sx * scale


@needs_a8
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 9), channels=st.integers(1, 70),
       blocks=st.sampled_from([1, 2, 8, 9, 16, 17, 33]))
def test_int8_linear_a8_is_exact_and_batch_independent(seed, rows, channels, blocks):
    """Every output equals the integer reference bit for bit (the panel path up to K = 1024, the tiled one
    beyond), and each row's outputs do not depend on the other rows."""
    gen = torch.Generator().manual_seed(seed)
    d = 64 * blocks
    weight = torch.randn(channels, d, generator=gen)
    scale = weight.abs().amax(dim=1) / 127
    codes = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    sums = codes.sum(dim=1, dtype=torch.int32)
    x = torch.randn(rows, d, generator=gen) * 3
    out = torch.ops.llminfer_cpu.int8_linear_a8(x, codes, scale, sums)
    assert torch.equal(out, _a8_reference(x, codes, scale))
    for r in range(rows):
        assert torch.equal(torch.ops.llminfer_cpu.int8_linear_a8(x[r:r + 1].contiguous(), codes, scale, sums), out[r:r + 1])


@needs_a8
def test_int8_linear_a8_rows_with_nan_or_inf_give_nan():
    codes = torch.ones(5, 64, dtype=torch.int8)
    x = torch.ones(3, 64)
    x[0, 3], x[2, 0] = math.nan, math.inf
    out = torch.ops.llminfer_cpu.int8_linear_a8(x, codes, torch.ones(5), codes.sum(dim=1, dtype=torch.int32))
    assert bool(out[0].isnan().all()) and bool(out[2].isnan().all()) and torch.equal(out[1], torch.full((5,), 64.0))


@needs_kernels
def test_screen_candidates_scores_exactly_the_tokens_at_the_threshold():
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(1000, 64, generator=gen), torch.randn(3, 64, generator=gen)
    approx = x @ weight.T + torch.randn(3, 1000, generator=gen) * 0.01
    threshold = approx.amax(dim=1) - 1.0
    scored = approx.clone()
    found = torch.ops.llminfer_cpu.screen_candidates(scored, threshold, weight, x, 1000)
    hit = approx >= threshold[:, None]
    assert found == int(hit.sum())
    assert torch.equal(scored[~hit], approx[~hit])
    assert torch.allclose(scored[hit], (x @ weight.T)[hit], atol=1e-4)
    assert torch.ops.llminfer_cpu.screen_candidates(approx.clone(), threshold, weight, x, int(hit.sum(dim=1).min()) - 1) == -1
    with pytest.raises(RuntimeError, match="max_candidates"):
        torch.ops.llminfer_cpu.screen_candidates(approx.clone(), threshold, weight, x, -1)


def test_margin_grows_with_the_dot_length():
    assert 3 * 2.0**-8 < screen_margin(64) < screen_margin(4096) < 0.016


def test_non_finite_rows_fall_back_to_the_full_head():
    weight = torch.randn(50, 8)
    screen = _bf16_reference(weight)
    with torch.inference_mode():
        assert screen.logits(torch.tensor([[math.nan] * 8])) is None
        assert screen.logits(torch.zeros(1, 8)) is not None  # all-equal logits: every token a candidate


@needs_a_copy
def test_prepacked_head_screens_only_the_named_rows():
    torch.manual_seed(0)
    linear = nn.Linear(64, 3000, bias=False)
    head = PrepackedLinear(linear)
    assert attach_argmax_screen(head, min_elements=0, require_faster=False)
    x = torch.randn(1, 5, 64)
    with torch.inference_mode():
        full = head(x)
        with argmax_only(head, [1, 3]):
            mixed = head(x)
        assert head.argmax_only_rows == ()
    assert torch.equal(mixed[0, [0, 2, 4]], full[0, [0, 2, 4]])  # rows that need logits get all of them
    assert not torch.equal(mixed[0, [1, 3]], full[0, [1, 3]])  # screened: exact only at the candidates
    assert mixed[0, [1, 3]].argmax(-1).tolist() == full[0, [1, 3]].argmax(-1).tolist()
    with torch.no_grad():
        linear.weight.mul_(-1)  # an in-place change makes the copy stale: the full head again
    with torch.inference_mode():
        full = head(x)
        with argmax_only(head, [0, 1, 2, 3, 4]):
            assert torch.equal(head(x), full)
    linear.weight.data = linear.weight.data.clone()  # so does a replaced tensor
    assert head.argmax_screen.stale


@needs_kernels
def test_rows_beside_screened_ones_keep_their_bits():
    """The rows that need logits take the kernel the whole step would take (llminfer's up to 8 rows, oneDNN
    beyond), not the one their own count would pick."""
    torch.manual_seed(0)
    head = PrepackedLinear(nn.Linear(64, 3000, bias=False))
    head.kernel_rows = 8
    assert attach_argmax_screen(head, min_elements=0, require_faster=False)
    for total, screened in ((12, [0, 1, 2, 3, 4, 5]), (12, [3]), (5, [1, 3])):
        x = torch.randn(total, 64)
        with torch.inference_mode():
            full = head(x)
            with argmax_only(head, screened):
                mixed = head(x)
        others = [i for i in range(total) if i not in screened]
        assert torch.equal(mixed[others], full[others])


def test_a_copy_whose_bound_keeps_too_many_candidates_is_dropped():
    weight = torch.randn(300, 8)
    loose = ScreenProduct("loose", _bf16_matmul(weight), lambda x: torch.full((x.shape[0], 1), 1e9), 0)
    tight = _bf16_reference(weight).products[0][1]
    screen = ArgmaxScreen(weight, [(1, loose), (2**31, tight)])
    x = torch.randn(1, 8)
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr("llminfer.kernels.argmax_screen.MAX_CANDIDATES_PER_ROW", 10)
        for _ in range(16):
            screen.logits(x)
        assert screen.dropped == ["loose"] and screen.product_for(1) is tight
        assert screen.logits(x) is not None
        only = ArgmaxScreen(weight, [(2**31, loose)])
        for _ in range(16):
            assert only.logits(x) is None
        assert not only.active


@needs_a_copy
@pytest.mark.parametrize("where", ["model", "global"])
def test_a_hook_that_can_see_the_logits_turns_the_screen_off(where):
    with make_engine(builtin_model_path(), cpu_argmax_screen=False) as engine:
        head = engine.backend.output_head
        assert attach_argmax_screen(head, min_elements=0, require_faster=False)
        assert engine.backend.screenable_head() is head
        handle = (engine.model.register_forward_hook(lambda *a: None) if where == "model"
                  else torch.nn.modules.module.register_module_forward_hook(lambda *a: None))
        try:
            assert engine.backend.screenable_head() is None
            engine.run("Hello", max_new_tokens=3, temperature=0.0)
            assert engine.backend.describe()["argmax_screen"]["rows"] == 0
        finally:
            handle.remove()


@needs_a_copy
def test_engine_greedy_tokens_equal_with_and_without_the_screen():
    prompts = ["Hello there", "The capital of", "a b c d e f", "x"]
    kinds = [dict(temperature=0.0), dict(temperature=0.0, logprobs=2), dict(temperature=0.8, seed=3),
             dict(temperature=0.0, min_new_tokens=6)]
    results = {}
    for screen in (False, True):
        with make_engine(builtin_model_path(), cpu_argmax_screen=False) as engine:
            if screen:
                assert attach_argmax_screen(engine.backend.output_head, min_elements=0, require_faster=False)
            results[screen] = [engine.run(p, max_new_tokens=12, **kw) for p, kw in zip(prompts, kinds)]
            info = engine.backend.describe()["argmax_screen"]
            assert (info is not None and info["rows"] > 0) == screen
    for plain, screened in zip(results[False], results[True]):
        assert plain.token_ids == screened.token_ids
    assert results[True][1].logprobs == results[False][1].logprobs  # logprob rows take the full head


@needs_kernels
def test_the_torch_candidate_path_finds_the_same_tokens_as_the_fused_one():
    """Where the kernels are not loaded the screen scans and scores in numpy and torch: the same candidates,
    the same argmax, the same count, as the C++ pass."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(5000, 64, generator=gen) * 0.05
    x = torch.randn(4, 64, generator=gen)
    fused, plain = (ArgmaxScreen(weight, [(0, int8_screen(weight))]) for _ in range(2))
    plain._fused = False
    with torch.inference_mode():
        a, b = fused.logits(x), plain.logits(x)
    assert fused._fused and a is not None and b is not None
    assert a.argmax(dim=1).tolist() == b.argmax(dim=1).tolist() == (x @ weight.T).argmax(dim=1).tolist()
    assert fused.candidates == plain.candidates > 0


@needs_bf16_kernel
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 4), vocab=st.integers(2, 600),
       d=st.sampled_from([32, 64, 96]), ties=st.integers(0, 5), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_a_bf16_head_screen_keeps_the_bf16_kernel_argmax(seed, rows, vocab, d, ties, scale):
    """A bf16 head's screen scores its candidates on the head's own kernel: the argmax, ties broken by the lowest
    index, is that of ``bf16_linear`` over the whole vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, d, generator=gen) * 0.05).to(torch.bfloat16)
    x = (torch.randn(rows, d, generator=gen) * scale).to(torch.bfloat16)
    top = int(bf16_linear(x[:1].contiguous(), weight)[0].float().argmax())
    for k in range(min(ties, vocab - 1)):  # exact copies and one-ulp neighbours of the winner
        j = (top + 1 + k) % vocab
        weight[j] = weight[top]
        if k % 2:
            weight[j, k % d] = torch.nextafter(weight[j, k % d].float(), torch.tensor(1.0)).to(torch.bfloat16)
    weight = weight.contiguous()
    full = bf16_linear(x, weight).float()
    for product in int8_screens(weight):
        screen = ArgmaxScreen(weight, [(0, product)], max_step_rows=4)
        with torch.inference_mode():
            out = screen.logits(x)
        if out is None:  # too many candidates: the caller runs the full head
            continue
        assert out.dtype == torch.float32
        assert out.argmax(dim=1).tolist() == full.argmax(dim=1).tolist(), product.name
        kept = out == full
        assert kept.any(dim=1).all()  # each row's winner is a scored candidate


@needs_bf16_kernel
def test_a_bf16_head_is_screened_only_where_its_own_kernel_runs():
    """Steps of up to ``kernel_rows`` rows take the screen; a larger step runs oneDNN's full product, bit for
    bit, as without a screen."""
    torch.manual_seed(1)
    head = PrepackedLinear(nn.Linear(64, 3000, bias=False).to(torch.bfloat16))
    assert not attach_argmax_screen(head, min_elements=0, require_faster=False)  # no kernel_rows: no screen
    head.kernel_rows = 4
    assert attach_argmax_screen(head, min_elements=0, require_faster=False)
    assert set(head.argmax_screen_probe_ms) <= {f"{n}_{r}" for n in ("bf16", "int8", "int8-a8") for r in (1, 2)}
    for total, screened in ((1, [0]), (4, [0, 1, 2, 3]), (4, [2]), (6, [0, 1, 2, 3, 4, 5])):
        x = torch.randn(total, 64).to(torch.bfloat16)
        before = head.argmax_screen.rows_screened
        with torch.inference_mode():
            full = head(x)
            with argmax_only(head, screened):
                mixed = head(x)
        if total > 4:
            assert head.argmax_screen.rows_screened == before and torch.equal(mixed, full)
            continue
        assert head.argmax_screen.rows_screened == before + len(screened)
        assert mixed.dtype == torch.float32
        assert mixed[screened].argmax(-1).tolist() == full[screened].float().argmax(-1).tolist()
        others = [i for i in range(total) if i not in screened]
        assert torch.equal(mixed[others], full[others].float())


@needs_bf16_kernel
def test_bf16_engine_greedy_tokens_equal_with_and_without_the_screen():
    prompts = ["Hello there", "The capital of", "a b c d e f", "x"]
    results = {}
    for screen in (False, True):
        with make_engine(builtin_model_path(), dtype="bfloat16", cpu_argmax_screen=False) as engine:
            if screen:
                assert attach_argmax_screen(engine.backend.output_head, min_elements=0, require_faster=False)
            results[screen] = [r.token_ids for r in engine.run_batch_continuous(prompts, max_new_tokens=12)]
            results[screen] += [engine.run(p, max_new_tokens=12, temperature=0.0).token_ids for p in prompts]
            info = engine.backend.describe()["argmax_screen"]
            assert (info is not None and info["rows"] > 0) == screen
    assert results[True] == results[False]


@needs_bf16_kernel
def test_a_bf16_score_tie_below_the_line_is_kept():
    """A bf16 head rounds its fp32 sums: two sums apart by less than a bf16 step can tie, and then the lower
    index wins. With an exact screen (no bound of its own) the tied token below the top sum must still be scored:
    the threshold widens by the rounding (``score_rounding``)."""
    d = 32
    weight = torch.zeros(8, d)
    weight[2:] = 0.01
    weight[0, :2] = torch.tensor([1.0, 2.0**-8 + 2.0**-12])  # 1.00415..., rounds up to 1 + 2^-7
    weight[1, :2] = torch.tensor([1.0, 2.0**-8 + 2.0**-10])  # 1.00488..., the larger sum, rounds the same
    weight = weight.to(torch.bfloat16).contiguous()
    x = torch.zeros(1, d, dtype=torch.bfloat16)
    x[0, :2] = 1.0
    full = bf16_linear(x, weight).float()
    assert full[0, 0] == full[0, 1] and int(full.argmax()) == 0
    exact = weight.float()

    def screen(rounding: float) -> ArgmaxScreen:
        product = ScreenProduct("exact", lambda xf: xf @ exact.T, lambda xf: torch.zeros(xf.shape[0], 1), 0,
                                score_rounding=rounding)
        return ArgmaxScreen(weight, [(0, product)], max_step_rows=4)

    with torch.inference_mode():
        assert int(screen(2.0**-8).logits(x).argmax()) == 0
        assert int(screen(0.0).logits(x).argmax()) == 1  # without the widening the tie is missed


@needs_kernels
def test_a_token_with_a_small_step_is_kept_beside_one_whose_rounding_lifts_it():
    """The int8 copy's rounding is bounded per token: the winner (small weights, a small step, no rounding) sits
    just above a token whose weights all round up by about half its 50x larger step. The line must take off the
    lifted token's own bound, not the winner's: else the winner and a runner-up (exact, a 10x larger step) are
    left unscored, and the runner-up's upper bound outranks the winner's."""
    d, step = 64, 0.01
    lifted = torch.full((d,), 0.51 * step)
    lifted[0] = 127 * step  # sets the row's step to ``step``: 0.51 steps round up to 1
    winner = torch.full((d,), float(lifted.sum()) / d * (1 + 1e-4))
    runner_up = torch.tensor([127.0] + [11.0] * 38 + [10.0] * 25) * 0.002  # 1.590, just below the winner
    weight = torch.cat([winner[None], lifted[None], runner_up[None], torch.full((5, d), 1e-4)]).contiguous()
    x = torch.ones(1, d)
    assert int((x @ weight.T).argmax()) == 0
    for product in int8_screens(weight):
        with torch.inference_mode():
            out = ArgmaxScreen(weight, [(0, product)]).logits(x)
        assert out is not None and int(out.argmax()) == 0, product.name


def test_a_spare_copy_takes_over_when_the_last_one_is_dropped():
    weight = torch.randn(300, 8)
    loose = ScreenProduct("loose", _bf16_matmul(weight), lambda x: torch.full((x.shape[0], 1), 1e9), 0)
    tight = _bf16_reference(weight).products[0][1]
    screen = ArgmaxScreen(weight, [(2**31, loose)], spares=[tight])
    x = torch.randn(1, 8)
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr("llminfer.kernels.argmax_screen.MAX_CANDIDATES_PER_ROW", 10)
        for _ in range(16):
            assert screen.logits(x) is None
        assert screen.dropped == ["loose"] and screen.product_for(4) is tight and screen.spares == []
        assert int(screen.logits(x).argmax()) == int((x @ weight.T).argmax())


@needs_a_copy
def test_the_backend_keeps_a_screen_the_dtype_measurement_attached(monkeypatch):
    """A head already screened while ``dtype="auto"`` was measured is not timed again; the measurement's steps
    are not counted as the engine's."""
    with make_engine(builtin_model_path(), cpu_argmax_screen=False) as engine:
        head = engine.backend.output_head
        assert attach_argmax_screen(head, min_elements=0, require_faster=False)
        with torch.inference_mode(), argmax_only(head, [0]):
            head(torch.randn(1, head.in_features))
        assert head.argmax_screen.rows_screened == 1
        monkeypatch.setattr("llminfer.kernels.argmax_screen.attach_argmax_screen",
                            lambda *a, **k: pytest.fail("timed again"))
        assert engine.backend.attach_argmax_screen()
        assert head.argmax_screen.rows_screened == 0 and head.argmax_screen.calls == {}


@needs_kernels
def test_spares_hold_no_bytes_of_their_own():
    """A copy the probe did not choose is kept as a spare only where it shares a chosen copy's bytes (the two int8
    copies): an unchosen bf16 copy is freed."""
    torch.manual_seed(2)
    head = PrepackedLinear(nn.Linear(64, 3000, bias=False))
    assert attach_argmax_screen(head, min_elements=0, require_faster=False)
    screen = head.argmax_screen
    held = [p.storage for _, p in screen.products]
    assert all(any(s.storage is h for h in held) for s in screen.spares)
    assert all(p.storage is not None for _, p in screen.products if p.name.startswith("int8"))
