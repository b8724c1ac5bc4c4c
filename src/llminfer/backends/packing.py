"""Packing one engine step: every sequence's new tokens in one row, the rows whose logits are wanted, and
the prompt positions whose logprobs the step yields.

The step backends (:mod:`.hf`, :mod:`.compiled`, :mod:`.speculative`) all run a :class:`PackedStep` made
by :meth:`PackedStep.from_plan`; only what they do with its logits differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from llminfer.backends.attention import PagedKVCache, build_metadata
from llminfer.backends.decoder_loop import forward_logits
from llminfer.protocols.messages import SchedulerOutput
from llminfer.results import TokenLogprob
from llminfer.sampling.sampler import SamplingState


def run_packed(
    model: torch.nn.Module,
    cache: PagedKVCache,
    tokens: Sequence[Sequence[int]],
    starts: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    keep_rows: Sequence[int],
    device: torch.device,
    attention_backend: str = "torch",
) -> torch.Tensor:
    """One forward pass over a packed row of every sequence's new tokens, writing their K/V into ``cache``
    (through :func:`~llminfer.backends.decoder_loop.forward_logits`: llminfer's decoder loop where it knows
    the model's family, else ``model(...)``; the same bits either way).

    Args:
        tokens: per sequence, the tokens to compute (their positions start at ``starts[i]``).
        block_tables: per sequence, KV block ids covering those positions.
        keep_rows: indices into the packed row whose logits are wanted.
        attention_backend: ``"torch"``, ``"cpu"`` (llminfer's CPU decode kernel) or ``"triton"`` (resolved, see
            :func:`~llminfer.backends.triton_attention.resolve_attention_backend`).

    Returns:
        ``[len(keep_rows), V]`` float32 logits.
    """
    flat = [t for seq in tokens for t in seq]
    meta, position_ids = build_metadata(cache, starts, [len(t) for t in tokens], block_tables, device,
                                        attention_backend)
    ids = torch.tensor(flat, dtype=torch.long, device=device)[None]
    keep = torch.tensor(list(keep_rows) or [len(flat) - 1], dtype=torch.long, device=device)
    max_position = max(s + len(t) for s, t in zip(starts, tokens)) - 1
    with torch.inference_mode():
        logits = forward_logits(model, ids, position_ids, keep, meta, max_position)[0].float()
    return logits if keep_rows else logits[:0]


@attrs.frozen
class PromptLogprobJob:
    """The prompt positions of one sequence whose logprobs this step yields.

    Attributes:
        request_id: the request.
        first_position: prompt position of the first target (>= 1).
        targets: the prompt tokens at ``first_position, first_position + 1, ...``.
        k: top alternatives to report.
        rows: their rows in the packed step (the logits row before each target).
    """

    request_id: str
    first_position: int
    targets: tuple[int, ...]
    k: int
    rows: tuple[int, ...]


def prompt_logprob_jobs(plan: SchedulerOutput, states: Mapping[str, SamplingState],
                        lengths: Sequence[int] | None = None) -> list[PromptLogprobJob]:
    """What the step's sequences with ``prompt_logprobs`` need: the row of each computed prompt position
    whose next token is also a prompt token (its logits give that token's logprob).

    Args:
        lengths: per sequence, its tokens in the packed row (default: ``len(token_ids)``; speculative
            decoding appends draft tokens).
    """
    jobs = []
    offset = 0
    for i, s in enumerate(plan.sequences):
        n = len(s.token_ids)
        state = states.get(s.request_id)
        if state is not None and state.params.prompt_logprobs is not None:
            start = s.start_position
            end = min(start + n, state.num_prompt - 1)  # positions whose next token is in the prompt
            if end > start:
                jobs.append(PromptLogprobJob(s.request_id, start + 1, tuple(state.token_ids[start + 1 : end + 1]),
                                             state.params.prompt_logprobs,
                                             tuple(range(offset, offset + end - start))))
        offset += lengths[i] if lengths is not None else n
    return jobs


def prompt_logprobs(logits: torch.Tensor, jobs: Sequence[PromptLogprobJob]) -> dict[str, tuple[int, tuple[TokenLogprob, ...]]]:
    """Log-softmax of raw logits at the jobs' rows: each target's logprob and rank, and the top-k.

    Args:
        logits: ``[sum(len(job.rows)), V]`` float32, the jobs' rows in order (overwritten with logprobs).

    Returns:
        ``{request_id: (first_position, entries)}`` for :class:`~llminfer.protocols.messages.StepOutput`.
    """
    out: dict[str, tuple[int, tuple[TokenLogprob, ...]]] = {}
    logits -= logits.logsumexp(dim=-1, keepdim=True)  # in place: the rows can be many
    row = 0
    for job in jobs:
        lp = logits[row : row + len(job.rows)]
        row += len(job.rows)
        targets = torch.tensor(job.targets, dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, targets[:, None])
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        top_ids: list[list[int]] = [[] for _ in job.targets]
        top_values: list[list[float]] = [[] for _ in job.targets]
        if job.k:
            values, ids = torch.topk(lp, job.k, dim=-1)
            top_ids, top_values = ids.tolist(), values.tolist()
        entries = tuple(TokenLogprob(t, v, tuple(zip(ti, tv)), r) for t, v, ti, tv, r in
                        zip(job.targets, chosen[:, 0].tolist(), top_ids, top_values, ranks))
        out[job.request_id] = (job.first_position, entries)
    return out


@attrs.frozen
class PackedStep:
    """One step's model input: per sequence the tokens to compute, packed one after another.

    Attributes:
        tokens: per sequence (plan order), its scheduled tokens, then its draft tokens if it has any.
        starts: per sequence, the position of its first token.
        block_tables: per sequence, KV block ids covering its positions.
        sample_rows: the packed rows whose logits are sampled, in plan order: a sampling sequence's last
            row; for a sequence with drafts, its last scheduled row and every draft row (``1 + drafts``
            rows, verified together).
        jobs: the prompt-logprob rows (:func:`prompt_logprob_jobs`), wanted after the sample rows.
    """

    tokens: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    sample_rows: tuple[int, ...]
    jobs: tuple[PromptLogprobJob, ...] = ()

    @classmethod
    def from_plan(cls, plan: SchedulerOutput, states: Mapping[str, SamplingState],
                  drafts: Mapping[str, Sequence[int]] | None = None) -> PackedStep:
        """Pack ``plan``, with ``drafts`` (request id -> draft tokens) appended to their sequences.

        Args:
            states: the requests' sampling states (for their prompt-logprob settings).
        """
        drafts = drafts or {}
        tokens, rows = [], []
        offset = 0
        for s in plan.sequences:
            seq_drafts = tuple(drafts.get(s.request_id, ()))
            tokens.append(tuple(s.token_ids) + seq_drafts)
            offset += len(s.token_ids) + len(seq_drafts)
            if s.request_id in drafts:
                rows.extend(range(offset - len(seq_drafts) - 1, offset))
            elif s.sample:
                rows.append(offset - 1)
        jobs = prompt_logprob_jobs(plan, states, [len(t) for t in tokens])
        return cls(tuple(tokens), tuple(s.start_position for s in plan.sequences),
                   tuple(tuple(s.block_table) for s in plan.sequences), tuple(rows), tuple(jobs))

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed row."""
        return sum(len(t) for t in self.tokens)

    @property
    def keep_rows(self) -> list[int]:
        """The rows whose logits the step wants: :attr:`sample_rows`, then every job's rows."""
        return [*self.sample_rows, *(r for job in self.jobs for r in job.rows)]

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence computes one token after a prefix (the shape CUDA graphs capture)."""
        return bool(self.tokens) and all(len(t) == 1 and p > 0 for t, p in zip(self.tokens, self.starts))

    def run(self, model: torch.nn.Module, cache: PagedKVCache, device: torch.device,
            attention_backend: str = "torch") -> torch.Tensor:
        """:func:`run_packed` on this step.

        Returns:
            ``[len(keep_rows), V]`` float32 logits.
        """
        return run_packed(model, cache, self.tokens, self.starts, self.block_tables, self.keep_rows, device,
                          attention_backend)
