"""The batched sampler: per-request logits processors, then vectorised warpers and a draw.

Order inside one step, for each row (the semantics of the named Hugging Face processor, written anew):

1. per-row processors: ``logit_bias`` (OpenAI's, added first), then the history processors (they depend
   on the request's own tokens): repetition penalty (``RepetitionPenaltyLogitsProcessor``, over prompt + output), presence and frequency
   penalties (OpenAI definitions, over output tokens only), no-repeat n-gram (``NoRepeatNGramLogitsProcessor``,
   over prompt + output), bad words (``NoBadWordsLogitsProcessor``), EOS / stop ids masked below
   ``min_new_tokens``, and forced words (see :class:`ForcedWords`);
2. the structured-output mask, for the constrained rows in one batched call (a token the grammar does not
   allow next becomes -inf; EOS is allowed only where the grammar accepts). The grammar wins: if the bans
   of step 1 and the grammar together leave no token, the row's bans are dropped;
3. log-probabilities are read here when asked for (``logprobs``);
4. warpers, vectorised over the sampling rows: temperature, top-k, top-p, min-p;
5. greedy rows take the argmax; sampling rows draw from the softmax with their own ``torch.Generator``
   when seeded, so a seeded request gives the same tokens whatever else shares its batch. A constrained
   request's grammar then advances by its token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from llminfer.results import TokenLogprob
from llminfer.sampling.params import SamplingParams
from llminfer.sampling.structured import GrammarMatcher, allocate_bitmask, apply_bitmask

NEG_INF = float("-inf")


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Per row of ``x`` (``[S, V]``), the index of its first maximum (NaN counts as the maximum), as ints.

    On CPU in float32 this is NumPy's ``argmax``, which is SIMD-vectorised: torch's CPU ``argmax`` is
    not (measured on a 2-core AVX2 machine, ``[32, 151000]``: 57 -> 13 ms; ``[1, 151000]``: 2.1 -> 0.05
    ms). Both return the first index of the maximum, so the tokens are the same.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[-1]:
        return x.detach().numpy().argmax(axis=-1).tolist()
    return x.argmax(dim=-1).tolist()


class ForcedWords:
    """Forced phrases: each must appear in the output.

    Mechanism: a phrase that has not appeared yet is *forced* (every other logit masked) once the tokens
    left in the budget are just enough for all unsatisfied phrases, or at once when the budget is open
    (``max_new_tokens=None``); a phrase being forced is continued to its end; EOS and stop ids are masked
    while any phrase is unsatisfied. Guarantee: every phrase (as one of its tokenizations) is in the output
    when ``max_new_tokens`` >= the sum of the phrases' token lengths, unless a stop string ends the text
    first. A phrase that appears naturally counts as satisfied.
    """

    def __init__(self, phrases: Sequence[Sequence[tuple[int, ...]]], max_new_tokens: int | None) -> None:
        self.phrases = [tuple(variants) for variants in phrases if variants]
        self.max_new_tokens = max_new_tokens
        self.satisfied = [False] * len(self.phrases)
        self.active: tuple[int, ...] | None = None
        self.position = 0

    def update(self, output: list[int]) -> None:
        for i, variants in enumerate(self.phrases):
            if not self.satisfied[i]:
                for v in variants:
                    n = len(v)
                    if n <= len(output) and tuple(output[-n:]) == v:
                        self.satisfied[i] = True
        if self.active is not None:
            self.position += 1
            if self.position >= len(self.active):
                self.active = None

    @property
    def pending(self) -> bool:
        return not all(self.satisfied)

    def forced_token(self, num_generated: int) -> int | None:
        if self.active is None:
            todo = [self.phrases[i][0] for i, ok in enumerate(self.satisfied) if not ok]
            if not todo:
                return None
            need = sum(len(v) for v in todo)
            left = None if self.max_new_tokens is None else self.max_new_tokens - num_generated
            if left is not None and left > need:
                return None
            self.active, self.position = todo[0], 0
        return self.active[self.position]


class SamplingState:
    """Per-request sampler state kept by the backend between steps.

    Args:
        params: the request's sampling parameters.
        device: where the request's generator lives.
        prompt_token_ids: the prompt (history for repetition penalty and n-grams).
        bad_words_ids / force_words_ids: token sequences from the tokenize stage.
        eos_token_ids: suppressed below ``min_new_tokens`` and while forced words are pending.
        grammar: the compiled structured-output grammar (``xgrammar.CompiledGrammar``), or None.
    """

    __slots__ = ("params", "generator", "token_ids", "num_prompt", "output_counts", "ngrams", "bad_single",
                 "bad_multi", "forced", "eos_token_ids", "history_tensor", "grammar", "bias")

    def __init__(self, params: SamplingParams, device: torch.device | str, prompt_token_ids: Sequence[int] = (),
                 bad_words_ids: Sequence[tuple[int, ...]] = (),
                 force_words_ids: Sequence[Sequence[tuple[int, ...]]] = (),
                 eos_token_ids: Sequence[int] = (), grammar: Any = None) -> None:
        self.params = params
        self.grammar = GrammarMatcher(grammar) if grammar is not None else None
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt = len(self.token_ids)
        self.output_counts: Counter[int] = Counter()
        self.eos_token_ids = tuple(eos_token_ids)
        self.ngrams: dict[tuple[int, ...], set[int]] | None = None
        n = params.no_repeat_ngram_size
        if n:
            self.ngrams = {}
            for start in range(len(self.token_ids) - n + 1):
                gram = self.token_ids[start : start + n]
                self.ngrams.setdefault(tuple(gram[:-1]), set()).add(gram[-1])
        self.bad_single = [w[0] for w in bad_words_ids if len(w) == 1]
        self.bad_multi = [w for w in bad_words_ids if len(w) > 1]
        self.forced = ForcedWords(force_words_ids, params.max_new_tokens) if force_words_ids else None
        self.history_tensor: torch.Tensor | None = None
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias = (torch.tensor(ids, dtype=torch.long, device=device),
                         torch.tensor(values, dtype=torch.float32, device=device))

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    def append(self, token: int) -> None:
        """Record the token chosen for this request."""
        self.token_ids.append(token)
        self.output_counts[token] += 1
        self.history_tensor = None
        n = self.params.no_repeat_ngram_size
        if self.ngrams is not None and len(self.token_ids) >= n:
            gram = self.token_ids[-n:]
            self.ngrams.setdefault(tuple(gram[:-1]), set()).add(gram[-1])
        if self.forced is not None:
            self.forced.update(self.token_ids[self.num_prompt :])
        if self.grammar is not None and not self.grammar.terminated:
            self.grammar.accept(token)  # the token came from the grammar's own mask

    @property
    def can_ban_everything(self) -> bool:
        return self.ngrams is not None or bool(self.bad_single or self.bad_multi)

    def banned_stop_ids(self) -> list[int]:
        """EOS and stop ids to mask now: below ``min_new_tokens``, or while forced words are pending."""
        p = self.params
        if self.num_generated < p.min_new_tokens or (self.forced is not None and self.forced.pending):
            return [*p.stop_token_ids, *([] if p.ignore_eos else self.eos_token_ids)]
        return []

    def process(self, row: torch.Tensor) -> None:
        """Apply this request's per-row processors (``logit_bias``, then the history-dependent ones) to its
        ``[V]`` float32 logits, in place."""
        p = self.params
        if self.bias is not None:
            ids, values = self.bias
            row[ids] += values.to(row.dtype)
        if p.repetition_penalty != 1.0 and self.token_ids:
            if self.history_tensor is None:
                self.history_tensor = torch.tensor(self.token_ids, dtype=torch.long, device=row.device)
            idx = self.history_tensor
            score = row[idx]
            row[idx] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.output_counts:
            ids = torch.tensor(list(self.output_counts.keys()), dtype=torch.long, device=row.device)
            counts = torch.tensor(list(self.output_counts.values()), dtype=row.dtype, device=row.device)
            row[ids] -= p.frequency_penalty * counts + p.presence_penalty
        if self.ngrams is not None:
            n = p.no_repeat_ngram_size
            if len(self.token_ids) + 1 >= n:
                banned = self.ngrams.get(tuple(self.token_ids[len(self.token_ids) - n + 1 :]) if n > 1 else ())
                if banned:
                    row[list(banned)] = NEG_INF
        if self.bad_single:
            row[self.bad_single] = NEG_INF
        for word in self.bad_multi:
            prefix = word[:-1]
            if len(self.token_ids) >= len(prefix) and tuple(self.token_ids[-len(prefix) :]) == prefix:
                row[word[-1]] = NEG_INF
        if self.forced is not None:
            token = self.forced.forced_token(self.num_generated)
            if token is not None:
                keep = row[token].clone()
                row.fill_(NEG_INF)
                row[token] = keep if torch.isfinite(keep) else 0.0


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (``top_k`` ``[S]`` int64, 0 = off); others become -inf.
    Ties at the k-th value are kept, as in Hugging Face's ``TopKLogitsWarper``."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, NEG_INF)


_TOP_P_CANDIDATES = 1024


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2019): drop the tokens whose ascending cumulative probability
    is <= ``1 - top_p``, always keeping the most likely one (Hugging Face ``TopPLogitsWarper``).

    For a large vocabulary, when the mass outside the 1,024 most likely tokens is already <= ``1 - top_p``
    (those tokens are dropped anyway), only the candidates are sorted: a full sort of a 150k vocabulary
    costs tens of ms per step on CPU.

    Args:
        logits: ``[S, V]`` float32.
        top_p: ``[S]`` in (0, 1], float64 (as the request gave it): ``1 - top_p`` is taken in float64 and
            then rounded to the logits' dtype, as Hugging Face compares with the Python float ``1 - top_p``
            (a ``top_p`` just below 1 rounds to 1.0 in float32, which would drop nothing).
    """
    vocab = logits.shape[-1]
    drop = (1 - top_p.double()).to(device=logits.device, dtype=logits.dtype)  # [S]: the mass that may be dropped
    if vocab > 4 * _TOP_P_CANDIDATES:
        probs = logits.softmax(dim=-1)
        top_probs, top_idx = probs.topk(_TOP_P_CANDIDATES, dim=-1)  # descending
        outside = (1.0 - top_probs.sum(dim=-1)).clamp_min(0.0)
        if bool((outside <= drop).all()):
            cum = outside[:, None] + top_probs.flip(-1).cumsum(dim=-1)  # ascending, like HF
            remove = cum <= drop[:, None]
            remove[:, -1] = False
            keep = ~remove.flip(-1)
            kept = torch.where(keep, logits.gather(1, top_idx), torch.full_like(top_probs, NEG_INF))
            return torch.full_like(logits, NEG_INF).scatter_(1, top_idx, kept)
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= drop[:, None]
    remove[:, -1] = False
    mask = remove.scatter(1, sorted_idx, remove)
    return logits.masked_fill(mask, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability
    (Nguyen et al. 2024; Hugging Face ``MinPLogitsWarper``)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, NEG_INF)


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
    uniforms = torch.cat([torch.rand(1, generator=g, dtype=torch.float64,
                                     device=probs.device if g is None else g.device) for g in generators])
    return inverse_cdf_draw(probs, uniforms)


def warp(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p over ``[S, V]`` float32 logits (one row per params entry)."""
    temperatures = [p.temperature for p in params]
    x = logits if all(t == 1.0 for t in temperatures) else logits / torch.tensor(
        temperatures, device=logits.device)[:, None]
    if any(p.top_k > 0 for p in params):
        x = apply_top_k(x, torch.tensor([p.top_k for p in params], device=x.device))
    if any(p.top_p < 1.0 for p in params):
        x = apply_top_p(x, torch.tensor([p.top_p for p in params], dtype=torch.float64))  # on the CPU: not all
        # devices have float64
    if any(p.min_p > 0.0 for p in params):
        x = apply_min_p(x, torch.tensor([p.min_p for p in params], device=x.device, dtype=x.dtype))
    return x


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
            guard(row, states[row].grammar.fill_bitmask, bitmask, row)  # type: ignore[union-attr]
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
        probs = warp(picked, [states[i].params for i in rows]).softmax(dim=-1)
        for j, tok in enumerate(draw(probs, [states[i].generator for i in rows])):
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
