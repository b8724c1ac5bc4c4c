"""The batched sampler: per-request logits processors, then vectorised warpers and a draw.

Order inside one step, for each row (the semantics of the named Hugging Face processor, written anew):

1. EOS / stop ids masked below ``min_new_tokens`` (and while forced words are pending), in one batched
   write; then the per-row processors of :data:`~llminfer.sampling.processors.ROW_PROCESSORS` in their
   order (``logit_bias`` first, then the ones that read the request's own tokens);
2. the structured-output mask, for the constrained rows in one batched call (a token the grammar does not
   allow next becomes -inf; EOS is allowed only where the grammar accepts). The grammar wins: if the bans
   of step 1 and the grammar together leave no token, the row's bans are dropped;
3. log-probabilities are read here when asked for (``logprobs``);
4. the warpers of :data:`~llminfer.sampling.warpers.WARPERS`, vectorised over the sampling rows
   (temperature, top-k, top-p, min-p);
5. greedy rows take the argmax; sampling rows draw from the softmax with their own ``torch.Generator``
   when seeded, so a seeded request gives the same tokens whatever else shares its batch. A constrained
   request's grammar then advances by its token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llminfer.errors import InvalidRequestError
from llminfer.results import TokenLogprob
from llminfer.sampling.params import SamplingParams
from llminfer.sampling.processors import ROW_PROCESSORS, ForcedWords, RequestHistory, RowProcessor
from llminfer.sampling.structured import PARAM, GrammarMatcher, allocate_bitmask, apply_bitmask
from llminfer.sampling.warpers import WARPERS, Temperature, apply_top_k, apply_top_p

NEG_INF = float("-inf")
__all__ = ["ForcedWords", "SamplingState", "apply_top_k", "apply_top_p", "argmax_rows", "draw", "sample", "warp"]


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Per row of ``x`` (``[S, V]``), the index of its first maximum (NaN counts as the maximum), as ints.

    On CPU in float32 this is NumPy's ``argmax``, which is SIMD-vectorised: torch's CPU ``argmax`` is
    not (measured on a 2-core AVX2 machine, ``[32, 151000]``: 57 -> 13 ms; ``[1, 151000]``: 2.1 -> 0.05
    ms). Both return the first index of the maximum, so the tokens are the same.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[-1]:
        return x.detach().numpy().argmax(axis=-1).tolist()
    return x.argmax(dim=-1).tolist()


def generator_seed(seed: int, device: torch.device) -> int:
    """The value a request's ``seed`` (an int in [-2**63, 2**64)) seeds its ``torch.Generator`` on ``device`` with.

    A CPU generator (mt19937) keeps only the low 32 bits of its seed, so seeds differing in their high bits
    (-1 and 2**63 - 1, 0 and 2**32) would draw the same tokens. There the high 32 bits are folded into the low
    ones (times an odd constant, so that high bits of 0 change nothing: seeds below 2**32 are used as they are).
    Other devices' generators (Philox on CUDA) use all 64 bits and get the seed as given.
    """
    if torch.device(device).type != "cpu":
        return seed
    bits = seed % 2**64  # a negative seed as torch reads it (two's complement)
    return (bits & 0xFFFFFFFF) ^ (((bits >> 32) * 0x9E3779B1) & 0xFFFFFFFF)


class SamplingState(RequestHistory):
    """Per-request sampler state kept by the backend between steps: the request's tokens so far and its
    row processors (:data:`~llminfer.sampling.processors.ROW_PROCESSORS` that apply, one instance each).

    Args:
        params: the request's sampling parameters.
        device: where the request's generator and processor tensors live.
        prompt_token_ids: the prompt (history for repetition penalty and n-grams).
        bad_words_ids / force_words_ids: token sequences from the tokenize stage.
        eos_token_ids: suppressed below ``min_new_tokens`` and while forced words are pending.
        grammar: the compiled structured-output grammar (``xgrammar.CompiledGrammar``), or None.
    """

    __slots__ = ("params", "generator", "token_ids", "num_prompt", "eos_token_ids", "grammar", "processors",
                 "forced", "argmax_only")

    def __init__(self, params: SamplingParams, device: torch.device | str, prompt_token_ids: Sequence[int] = (),
                 bad_words_ids: Sequence[tuple[int, ...]] = (),
                 force_words_ids: Sequence[Sequence[tuple[int, ...]]] = (),
                 eos_token_ids: Sequence[int] = (), grammar: Any = None) -> None:
        self.params = params
        self.grammar = GrammarMatcher(grammar) if grammar is not None else None
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(generator_seed(params.seed, self.generator.device))
        self.token_ids = list(prompt_token_ids)
        self.num_prompt = len(self.token_ids)
        self.eos_token_ids = tuple(eos_token_ids)
        context = {"device": device, "bad_words_ids": bad_words_ids, "force_words_ids": force_words_ids}
        self.processors: list[RowProcessor] = [
            p for cls in ROW_PROCESSORS if (p := cls.for_request(params, self, context)) is not None]
        forced = [p for p in self.processors if isinstance(p, ForcedWords)]
        self.forced: ForcedWords | None = forced[0] if forced else None
        #: Whether every token of this request is the plain argmax of the raw logits: greedy, with no
        #: processor, ban, grammar or logprobs reading them (``SamplingParams.speculation_allowed`` covers all of
        #: those; the request's parameters do not change, so it is decided once).
        self.argmax_only = params.greedy and params.speculation_allowed

    def append(self, token: int) -> None:
        """Record the token chosen for this request."""
        self.token_ids.append(token)
        for processor in self.processors:
            processor.update(self, token)
        if self.grammar is not None and not self.grammar.terminated:
            self.grammar.accept(token)  # the token came from the grammar's own mask

    @property
    def can_ban_everything(self) -> bool:
        return any(p.can_ban_everything for p in self.processors)

    def banned_stop_ids(self) -> list[int]:
        """EOS and stop ids to mask now: below ``min_new_tokens``, or while forced words are pending."""
        p = self.params
        if self.num_generated < p.min_new_tokens or (self.forced is not None and self.forced.pending):
            return [*p.stop_token_ids, *([] if p.ignore_eos else self.eos_token_ids)]
        return []

    def process(self, row: torch.Tensor) -> None:
        """Apply this request's row processors, in order, to its ``[V]`` float32 logits, in place."""
        for processor in self.processors:
            processor(row, self)


_DRAW_BLOCK = 1024


def inverse_cdf_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """Inverse-CDF sampling: per row of ``probs``, the first token whose cumulative probability exceeds
    ``uniform * total``.

    Two levels, so that no float32 running sum spans the whole vocabulary: the sums of blocks of 1024
    tokens (float32, vectorised), accumulated in float64 and searched for the block; then that block's
    cumulative sum in float64, searched for the token. A token of probability 0 is never drawn (its
    interval is empty), and a row whose total is not exactly 1 (rounding) is scaled by its own total; a
    row with no positive mass (NaN, all zeros) gets its argmax. Each row depends only on its own values, so
    the draw is the same whatever else shares the batch.

    Args:
        probs: ``[S, V]`` float32 (or float64) on any device, non-negative (a softmax; NaN rows allowed).
        uniforms: ``[S]`` float64 in [0, 1), one per row (moved to ``probs``'s device).

    Returns:
        ``S`` token ids in ``[0, V)``. Raises nothing for a bad row (see above).
    """
    rows, vocab = probs.shape
    full = vocab // _DRAW_BLOCK
    sums = probs[:, :full * _DRAW_BLOCK].unflatten(1, (full, _DRAW_BLOCK)).sum(dim=-1)  # a view: no copy
    if vocab % _DRAW_BLOCK:
        sums = torch.cat([sums, probs[:, full * _DRAW_BLOCK:].sum(dim=-1, keepdim=True)], dim=1)
    block_cum = sums.to(torch.float64).cumsum(dim=-1)  # [S, nb]
    target = uniforms.to(device=probs.device, dtype=torch.float64) * block_cum[:, -1]
    nb = block_cum.shape[1]
    block = torch.searchsorted(block_cum, target[:, None], right=True)[:, 0]
    # Rounding can put the target at or past a total: fall back to the last block / token of positive mass.
    last_block = torch.where(sums > 0, torch.arange(nb, device=probs.device), -1).amax(dim=-1)
    block = torch.minimum(block, last_block).clamp_min_(0)  # -1: a row without positive mass (below)
    before = torch.where(block > 0, block_cum.gather(1, (block - 1).clamp_min(0)[:, None])[:, 0],
                         torch.zeros_like(target))
    steps = torch.arange(_DRAW_BLOCK, device=probs.device)
    cols = block[:, None] * _DRAW_BLOCK + steps  # [S, 1024]
    picked = torch.where(cols < vocab, probs.gather(1, cols.clamp(max=vocab - 1)), 0)
    inner = picked.to(torch.float64).cumsum(dim=-1)
    offset = torch.searchsorted(inner, (target - before)[:, None], right=True)[:, 0]
    last_token = torch.where(picked > 0, steps, -1).amax(dim=-1)
    tokens = block * _DRAW_BLOCK + torch.minimum(offset, last_token)
    # A row with no positive finite mass (NaN logits from an overflowing model, or all zeros) has nothing to
    # draw from: it gets what greedy would pick (the first maximum, NaN counting as the maximum), as one
    # bad row must not fail the batch.
    empty = ~(block_cum[:, -1] > 0)
    if bool(empty.any()):
        tokens = torch.where(empty, probs.argmax(dim=-1), tokens)
    return tokens.tolist()


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``probs`` (``[S, V]`` float32 or float64, rows summing to ~1), each row from one
    float64 uniform of its own generator (None: torch's default one), so a seeded request draws the same
    tokens in any batch. ``generators`` has ``S`` entries, each on ``probs``'s device or None.

    One random number per row and two cheap passes over the vocabulary (:func:`inverse_cdf_draw`): measured
    on a 2-core AVX2 machine, ``[32, 151646]``, 1.4-2.1 ms (0.3-0.4 ms for one row), where an exponential
    race (``argmax(p / E)``, ``V`` random numbers per row from a per-request generator) took 126 ms and
    ``torch.multinomial`` 137 ms.

    Returns:
        ``S`` token ids.
    """
    return inverse_cdf_draw(probs, row_uniforms(generators, probs.device))


def row_uniforms(generators: Sequence[torch.Generator | None], device: torch.device | str) -> torch.Tensor:
    """``[S]`` float64 in [0, 1): one draw from each row's generator (None: torch's default one, on ``device``)."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=device if g is None else g.device)
                      for g in generators])


def _plain_temperature(params: SamplingParams) -> bool:
    """Whether no warper but the temperature applies (the fused draw's case)."""
    return not any(warper.applies(params) for warper in WARPERS if not isinstance(warper, Temperature))


def draw_sampled_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                      generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` (``[S, V]`` float32, one row per ``params`` entry): the warpers, the
    softmax and :func:`draw`, one uniform per row from its generator.

    Rows that only divide by their temperature take llminfer's ``softmax_draw`` op where the CPU kernels are
    loaded (``csrc/sample_draw.cpp``: the same inverse-CDF draw from the same uniform, its exponentials by a
    polynomial within 2 ulp, in two passes over the row: 0.9 against 3.6 ms for 32 rows of 151,646 logits on a
    2-core Zen 4); a row it cannot draw (a NaN or an infinite maximum) and every other row go the torch way. A
    row's token does not depend on the other rows.
    """
    from llminfer.kernels.build import kernels_loaded

    uniforms = row_uniforms(generators, logits.device)
    tokens = [-1] * len(params)
    fused = [j for j, p in enumerate(params) if _plain_temperature(p)] if (
        logits.is_cpu and logits.dtype == torch.float32 and kernels_loaded()) else []
    if fused:
        rows = logits if len(fused) == len(params) else logits.index_select(0, torch.tensor(fused))
        inverse_temperature = torch.tensor([1.0 / params[j].temperature for j in fused], dtype=torch.float32)
        drawn = torch.ops.llminfer_cpu.softmax_draw(rows, inverse_temperature, uniforms[fused]).tolist()
        for j, token in zip(fused, drawn):
            tokens[j] = token
    rest = [j for j, token in enumerate(tokens) if token < 0]
    if rest:
        rows = logits if len(rest) == len(params) else logits.index_select(0, torch.tensor(rest, device=logits.device))
        probs = warp(rows, [params[j] for j in rest]).softmax(dim=-1)
        for j, token in zip(rest, inverse_cdf_draw(probs, uniforms[rest])):
            tokens[j] = token
    return tokens


def warp(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The :data:`~llminfer.sampling.warpers.WARPERS` that any row uses, in order, over ``[S, V]`` float32
    logits (one row per params entry; a warper leaves the rows that do not use it unchanged)."""
    for warper in WARPERS:
        if any(warper.applies(p) for p in params):
            logits = warper(logits, params)
    return logits


def sample(
    logits: torch.Tensor,
    states: Sequence[SamplingState],
    errors: dict[int, BaseException] | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row and record it in the row's state.

    Args:
        logits: ``[S, V]`` float32, the last position's logits of each sampling sequence (modified in place).
        states: per row, the request's sampling state.
        errors: when given, a row whose own processing raises (its processors, its grammar, a stop id
            outside the vocabulary) is recorded here by row index instead of failing the batch; its token
            is then meaningless and its state untouched. None: the first such error propagates.

    Returns:
        ``S`` token ids, and per row a :class:`TokenLogprob` when the request asked for ``logprobs``.
    """
    def guard(row: int, fn: Any, *args: Any) -> Any:
        if errors is None:
            return fn(*args)
        if row in errors:
            return None
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - this row's request fails, the batch goes on
            errors[row] = exc
            return None

    vocab = logits.shape[-1]
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for row, state in enumerate(states):
        ids = guard(row, _stop_ids_to_ban, state, vocab) or []
        mask_rows.extend([row] * len(ids))
        mask_ids.extend(ids)
    constrained = [row for row, state in enumerate(states) if state.grammar is not None]
    # Only a constrained row that also has bans can be left with no token at all: keep its logits to
    # fall back on (the grammar wins over the bans).
    banned = set(mask_rows)
    fallback = [row for row in constrained if row in banned or states[row].params.needs_history]
    saved = logits[fallback].clone() if fallback else None
    if mask_rows:  # one indexed write for the whole batch (min_new_tokens is common in benchmarks)
        logits[torch.tensor(mask_rows), torch.tensor(mask_ids)] = NEG_INF
    for row, state in enumerate(states):
        if state.params.needs_history:
            guard(row, _process_row, state, logits[row])
    if constrained:
        bitmask = allocate_bitmask(len(states), logits.shape[-1])
        for row in constrained:
            guard(row, _fill_grammar_row, states[row].grammar, bitmask, row)
        apply_bitmask(logits, bitmask, constrained)
        if saved is not None:
            empty = [j for j, row in enumerate(fallback) if not bool(torch.isfinite(logits[row]).any())]
            if empty:  # bans and grammar together left nothing: the grammar wins
                rows = [fallback[j] for j in empty]
                logits[rows] = saved[empty]
                apply_bitmask(logits, bitmask, rows)
    if errors:
        logits[list(errors)] = 0.0  # a failed row must not disturb the batched draws below

    logprobs: list[TokenLogprob | None] = [None] * len(states)
    want_lp = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    lp_rows = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None

    rows = [i for i, s in enumerate(states) if not s.params.greedy]
    out = argmax_rows(logits) if len(rows) < len(states) else [0] * len(states)
    if rows:
        picked = logits if len(rows) == len(states) else logits.index_select(
            0, torch.tensor(rows, device=logits.device))
        drawn = draw_sampled_rows(picked, [states[i].params for i in rows], [states[i].generator for i in rows])
        for j, tok in enumerate(drawn):
            out[rows[j]] = tok

    if lp_rows is not None:
        for j, i in enumerate(want_lp):
            k = states[i].params.logprobs or 0
            row = lp_rows[j]
            top: tuple[tuple[int, float], ...] = ()
            if k:
                values, ids = torch.topk(row, k)
                top = tuple(zip(ids.tolist(), values.tolist()))
            logprobs[i] = TokenLogprob(out[i], float(row[out[i]]), top)

    for row, (state, tok) in enumerate(zip(states, out)):
        guard(row, state.append, tok)
    return out, logprobs


def _fill_grammar_row(grammar: GrammarMatcher, bitmask: torch.Tensor, row: int) -> None:
    """The grammar's allowed tokens into ``bitmask[row]``.

    Raises:
        InvalidRequestError: the grammar allows no token after the text so far (a JSON string whose pattern
            matches nothing): the request fails with it rather than decode masked tokens to its length limit.
    """
    grammar.fill_bitmask(bitmask, row)
    if not bool(bitmask[row].any()):
        raise InvalidRequestError("the structured-output constraint allows no token after the text so far: its "
                                  "schema, regular expression or grammar matches no complete text", param=PARAM)


def _stop_ids_to_ban(state: SamplingState, vocab: int) -> list[int]:
    ids = state.banned_stop_ids()
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"stop token id {bad[0]} is outside the vocabulary (size {vocab})")
    return ids


def _process_row(state: SamplingState, row: torch.Tensor) -> None:
    # Bans (n-grams, bad words) could in principle cover the whole vocabulary: keep a copy to fall back
    # on. EOS masking and penalties alone cannot, and a 150k-entry copy per row per step costs.
    saved_row = row.clone() if state.can_ban_everything and state.grammar is None else None
    state.process(row)
    if saved_row is not None and not bool(torch.isfinite(row).any()):
        row.copy_(saved_row)  # every token banned: ignore the bans rather than fail the request
