"""Speculative decoding on the paged KV cache: drafts from an assistant (draft) model, or from the
sequence's own tokens (prompt lookup, n-gram drafting).

Per engine step, for each decode sequence the scheduler gave ``num_lookahead`` spare slots:

1. the proposer drafts up to ``k`` tokens:

   - :class:`SpeculativeBackend`: the draft model catches up on the tokens it has not seen and proposes,
     one batched forward per proposal position, stopping early for a sequence whose top draft probability
     falls below ``confidence_threshold``;
   - :class:`PromptLookupBackend`: no model; the longest suffix n-gram of the sequence (prompt and output)
     that occurred earlier in it is looked up, and the tokens that followed that earlier occurrence are the
     drafts (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method, llama.cpp's lookup decoding).
     It pays off where the output copies spans of the prompt: summaries, extraction, code edits;
2. the target runs once over ``[last token, d1 .. dm]`` of every such sequence (packed with the other
   sequences' prefill chunks and decodes) and gives logits at each of those positions;
3. greedy requests keep the longest prefix of drafts equal to the target's argmax, then the target's own
   token; sampling requests use rejection sampling (Leviathan et al. 2023, "Fast Inference from
   Transformers via Speculative Decoding"; Chen et al. 2023): draft token ``d`` is accepted with
   probability ``min(1, p(d) / q(d))``, a rejection resamples from ``norm(max(0, p - q))``, and a full
   acceptance draws a bonus token from ``p``. The output distribution is the target's. An n-gram draft is
   a point mass (``q(d) = 1``), so ``d`` is accepted with probability ``p(d)`` and a rejection resamples
   from ``p`` without ``d``.

The draft keeps its own KV tensors but shares the target's block tables: its K/V for position ``i`` live at
the same slot, so no extra allocation or bookkeeping is needed, and prefix-cache hits carry draft KV too.
KV written for rejected drafts lies beyond ``num_computed_tokens`` and is overwritten later.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch

from llminfer.backends.attention import PagedKVCache
from llminfer.backends.base import StepBackend, StepResult
from llminfer.backends.packing import PackedStep, prompt_logprobs, run_packed
from llminfer.protocols.messages import ScheduledSequence, SchedulerOutput
from llminfer.sampling.sampler import SamplingState, argmax_rows, draw, warp


class _VerifyingBackend(StepBackend):
    """The eager step plus draft verification: subclasses propose drafts (:meth:`propose`), this class
    runs the target once over each sequence's ``[last token, d1 .. dm]`` and accepts a prefix of them."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, eos_token_ids: Sequence[int] = (),
                 num_speculative_tokens: int = 5, attention_backend: str = "torch") -> None:
        super().__init__(model, cache, eos_token_ids, attention_backend)
        self.k = num_speculative_tokens
        self.total_proposed = 0
        self.total_accepted = 0

    @abstractmethod
    def propose(self, plan: SchedulerOutput) -> dict[str, tuple[list[int], list[torch.Tensor | None]]]:
        """Drafts for the plan's sequences with ``num_lookahead > 0``: per request id, the proposed tokens
        and, per token, the draft distribution ``[V]`` (None for a point mass on the token)."""

    # ------------------------------------------------------------------ verification
    def verify(self, state: SamplingState, rows: torch.Tensor, proposed: list[int],
               dists: Sequence[torch.Tensor | None]) -> tuple[list[int], int]:
        """Accept a prefix of ``proposed`` against the target's ``[m + 1, V]`` logits ``rows``; ``dists``
        holds each draft's distribution ``[V]``, or None where the draft was certain (n-gram drafts).

        Returns:
            The tokens to append (accepted drafts then one target token) and how many drafts were accepted.
        """
        params = state.params
        if params.greedy:
            target = argmax_rows(rows)
            accepted = 0
            while accepted < len(proposed) and proposed[accepted] == target[accepted]:
                accepted += 1
            return proposed[:accepted] + [target[accepted]], accepted
        p = warp(rows, [params] * rows.shape[0]).softmax(dim=-1)
        gen = state.generator
        for i, (token, q) in enumerate(zip(proposed, dists)):
            u = float(torch.rand((), generator=gen)) if gen is not None else float(torch.rand(()))
            q_token = 1.0 if q is None else float(q[token])
            if u * q_token < float(p[i, token]):  # u < p/q without dividing by a tiny q
                continue
            if q is None:
                residual = p[i].clone()
                residual[token] = 0
            else:
                residual = (p[i] - q).clamp_min(0)
            if float(residual.sum()) <= 0:
                residual = p[i]
            return proposed[:i] + draw(residual[None], [gen]), i
        return proposed + draw(p[len(proposed)][None], [gen]), len(proposed)

    def run_step(self, plan: SchedulerOutput) -> StepResult:
        """Draft, run the target once over every sequence with its drafts appended, verify the drafts
        (accepted drafts, then one target token) and sample the sequences without drafts."""
        drafts = self.propose(plan)
        step = PackedStep.from_plan(plan, self.states, {rid: d[0] for rid, d in drafts.items()})
        logits = step.run(self.model, self.cache, self.device, self.attention_backend)
        n_rows = len(step.sample_rows)
        result = StepResult(prompt_logprobs=prompt_logprobs(logits[n_rows:], step.jobs) if step.jobs else {})
        plain_rows: list[int] = []
        plain: list[ScheduledSequence] = []
        row = 0
        for s in plan.sequences:
            if s.request_id in drafts:
                proposed, dists = drafts[s.request_id]
                n = len(proposed) + 1
                state = self.states[s.request_id]
                out, accepted = self.verify(state, logits[row : row + n], proposed, dists)
                for t in out:
                    state.append(t)
                result.sampled[s.request_id] = tuple(out)
                result.spec[s.request_id] = (len(proposed), accepted)
                self.total_proposed += len(proposed)
                self.total_accepted += accepted
                row += n
            elif s.sample:
                plain_rows.append(row)
                plain.append(s)
                row += 1
        if plain:
            self.sample_rows(logits[plain_rows], plain, result)
        return result

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed drafts since load, None before any proposal."""
        return self.total_accepted / self.total_proposed if self.total_proposed else None


class SpeculativeBackend(_VerifyingBackend):
    """The eager backend plus an assistant model that proposes tokens for the target to verify.

    Args:
        model, cache: the target model and its paged KV tensors.
        draft_model, draft_cache: the assistant and its KV tensors (same ``num_blocks`` and block size).
        num_assistant_tokens: most drafts per sequence per step (``k``).
        confidence_threshold: stop drafting for a sequence when the draft's top probability is below it.
    """

    name = "eager+speculative"

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, draft_model: torch.nn.Module,
                 draft_cache: PagedKVCache, eos_token_ids: Sequence[int] = (), num_assistant_tokens: int = 5,
                 confidence_threshold: float = 0.4) -> None:
        super().__init__(model, cache, eos_token_ids, num_assistant_tokens)
        self.draft = draft_model
        self.draft_cache = draft_cache
        self.confidence_threshold = confidence_threshold
        self.draft_computed: dict[str, int] = {}

    # ------------------------------------------------------------------ drafting
    def _draft_probs(self, state: SamplingState, logits: torch.Tensor) -> torch.Tensor:
        if state.params.greedy:
            return logits.softmax(dim=-1)
        return warp(logits[None], [state.params])[0].softmax(dim=-1)

    def propose(self, plan: SchedulerOutput) -> dict[str, tuple[list[int], list[torch.Tensor | None]]]:
        """Run the draft: keep its KV in step with every sequence, and propose tokens for the spec ones.

        Returns:
            Per speculating request: the proposed tokens and, per token, the draft distribution ``[V]``.
        """
        tokens, starts, tables, keep, spec = [], [], [], [], []
        offset = 0
        for s in plan.sequences:
            state = self.states[s.request_id]
            done = min(self.draft_computed.get(s.request_id, s.start_position), s.start_position)
            seq_tokens = state.token_ids[done : s.start_position] + list(s.token_ids)
            tokens.append(seq_tokens)
            starts.append(done)
            tables.append(s.block_table)
            offset += len(seq_tokens)
            self.draft_computed[s.request_id] = s.start_position + len(s.token_ids)
            if s.num_lookahead:
                keep.append(offset - 1)
                spec.append(s)
        out: dict[str, tuple[list[int], list[torch.Tensor | None]]] = {s.request_id: ([], []) for s in spec}
        if not tokens:
            return out
        logits = run_packed(self.draft, self.draft_cache, tokens, starts, tables, keep, self.device)
        active = list(spec)
        for step in range(self.k):
            still: list[ScheduledSequence] = []
            for row, s in enumerate(active):
                state = self.states[s.request_id]
                probs = self._draft_probs(state, logits[row])
                if state.params.greedy:
                    token = int(probs.argmax())
                else:
                    token = draw(probs[None], [state.generator])[0]
                if float(probs.max()) < self.confidence_threshold:
                    continue
                proposed, dists = out[s.request_id]
                proposed.append(token)
                dists.append(probs)
                if len(proposed) < s.num_lookahead:
                    still.append(s)
            active = still
            if not active or step == self.k - 1:
                break
            # Feed each active sequence its newest draft token at the next position.
            feed = [[out[s.request_id][0][-1]] for s in active]
            pos = [s.start_position + len(out[s.request_id][0]) for s in active]
            logits = run_packed(self.draft, self.draft_cache, feed, pos, [s.block_table for s in active],
                                list(range(len(active))), self.device)
            for s, p in zip(active, pos):
                self.draft_computed[s.request_id] = p + 1
        return out

    def release(self, request_ids: Sequence[str]) -> None:
        """Drop the sampling state and the draft's progress of finished requests."""
        super().release(request_ids)
        for rid in request_ids:
            self.draft_computed.pop(rid, None)


class NgramIndex:
    """Where each n-gram of a growing token list last occurred, for prompt-lookup drafting.

    ``tables[n]`` maps an n-gram (a tuple of ``n`` token ids) to ``j``, the position just after its most
    recent occurrence ending at or before :attr:`indexed`. Indexing is incremental (each token position is
    visited once over a request's life), so a lookup costs O(``n_max``) dict probes, not a scan of the
    context.

    Args:
        n_min, n_max: the n-gram sizes looked up, longest first (``1 <= n_min <= n_max``).
    """

    __slots__ = ("n_min", "n_max", "tables", "indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index the n-grams of ``tokens`` that end at positions ``(indexed, upto]`` (end exclusive)."""
        for j in range(self.indexed + 1, upto + 1):
            for n, table in self.tables.items():
                if j >= n:
                    table[tuple(tokens[j - n : j])] = j
        self.indexed = max(self.indexed, upto)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` drafts for the continuation of ``tokens``: what followed the most recent earlier
        occurrence of the longest suffix n-gram (``n_max`` down to ``n_min``) found; [] when none is."""
        length = len(tokens)
        # Exclude the n-grams ending at the last position: the suffix itself is its own latest occurrence.
        self.extend(tokens, length - 1)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            j = self.tables[n].get(tuple(tokens[length - n :]))
            if j is not None:
                return list(tokens[j : j + k])
        return []


class PromptLookupBackend(_VerifyingBackend):
    """The eager backend with prompt-lookup (n-gram) drafting: no draft model, the drafts are copied from
    earlier in the sequence (:class:`NgramIndex`) and verified like a draft model's.

    Args:
        model, cache: the target model and its paged KV tensors.
        num_speculative_tokens: most drafts per sequence per step (``k``).
        prompt_lookup_min, prompt_lookup_max: the n-gram sizes matched against the sequence's suffix.
        attention_backend: as :class:`~llminfer.backends.hf.HFBackend`'s (resolved for the device).
    """

    name = "eager+prompt-lookup"

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, eos_token_ids: Sequence[int] = (),
                 num_speculative_tokens: int = 5, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4,
                 attention_backend: str = "torch") -> None:
        super().__init__(model, cache, eos_token_ids, num_speculative_tokens, attention_backend)
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, plan: SchedulerOutput) -> dict[str, tuple[list[int], list[torch.Tensor | None]]]:
        """Per speculating request (``num_lookahead > 0``): up to ``min(k, num_lookahead)`` tokens from
        the n-gram index of its prompt and output so far; a request with no match drafts nothing (its
        step is a plain decode)."""
        out: dict[str, tuple[list[int], list[torch.Tensor | None]]] = {}
        for s in plan.sequences:
            if not s.num_lookahead:
                continue
            index = self.indexes.get(s.request_id)
            if index is None:
                index = self.indexes[s.request_id] = NgramIndex(self.prompt_lookup_min, self.prompt_lookup_max)
            tokens = self.states[s.request_id].token_ids[: s.start_position + len(s.token_ids)]
            drafts = index.propose(tokens, min(self.k, s.num_lookahead))
            if drafts:
                out[s.request_id] = (drafts, [None] * len(drafts))
        return out

    def release(self, request_ids: Sequence[str]) -> None:
        """Drop the sampling state and the n-gram index of finished requests."""
        super().release(request_ids)
        for rid in request_ids:
            self.indexes.pop(rid, None)
