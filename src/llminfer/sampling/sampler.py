"""The batched sampler: logits processors vectorised over the batch, then greedy or seeded sampling.

Order (as Hugging Face ``generate`` applies its warpers): EOS masking below ``min_new_tokens``,
temperature, top-k, top-p, min-p, then softmax and a draw. Greedy rows (temperature 0) take the argmax of
the unprocessed logits. Each request owns a ``torch.Generator`` when it has a seed, so its draws do not
depend on the other rows of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llminfer.sampling.params import SamplingParams


class SamplingState:
    """Per-request sampler state kept by the backend between steps."""

    __slots__ = ("params", "generator")

    def __init__(self, params: SamplingParams, device: torch.device | str) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (``top_k`` ``[S]`` int64, 0 = off); others become -inf.
    Ties at the k-th value are kept, as in Hugging Face's ``TopKLogitsWarper``."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2019): drop the tokens whose ascending cumulative probability
    is <= ``1 - top_p``, always keeping the most likely one (Hugging Face ``TopPLogitsWarper``).

    Args:
        logits: ``[S, V]`` float32.
        top_p: ``[S]`` float32 in (0, 1].
    """
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - top_p)[:, None]
    remove[:, -1] = False
    mask = remove.scatter(1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability
    (Nguyen et al. 2024; Hugging Face ``MinPLogitsWarper``)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def sample(
    logits: torch.Tensor,
    states: Sequence[SamplingState],
    num_generated: Sequence[int],
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """Pick one token per row.

    Args:
        logits: ``[S, V]`` float32, the last position's logits of each sampling sequence.
        states: per row, the request's sampling state.
        num_generated: per row, tokens generated so far (for ``min_new_tokens``).
        eos_token_ids: ids suppressed (with each request's ``stop_token_ids``) below ``min_new_tokens``.

    Returns:
        ``S`` token ids.
    """
    for row, (state, n) in enumerate(zip(states, num_generated)):
        p = state.params
        if n < p.min_new_tokens:
            banned = [*p.stop_token_ids, *([] if p.ignore_eos else eos_token_ids)]
            if banned:
                logits[row, banned] = float("-inf")

    greedy = [s.params.greedy for s in states]
    if all(greedy):
        return logits.argmax(dim=-1).tolist()

    out = logits.argmax(dim=-1).tolist()
    rows = [i for i, g in enumerate(greedy) if not g]
    idx = torch.tensor(rows, device=logits.device)
    params = [states[i].params for i in rows]
    x = logits.index_select(0, idx)
    x = x / torch.tensor([p.temperature for p in params], device=x.device)[:, None]
    if any(p.top_k > 0 for p in params):
        x = apply_top_k(x, torch.tensor([p.top_k for p in params], device=x.device))
    if any(p.top_p < 1.0 for p in params):
        x = apply_top_p(x, torch.tensor([p.top_p for p in params], device=x.device, dtype=x.dtype))
    if any(p.min_p > 0.0 for p in params):
        x = apply_min_p(x, torch.tensor([p.min_p for p in params], device=x.device, dtype=x.dtype))
    probs = x.softmax(dim=-1)
    unseeded = [j for j, i in enumerate(rows) if states[i].generator is None]
    if unseeded:
        draws = torch.multinomial(probs[unseeded], 1).squeeze(1).tolist()
        for j, tok in zip(unseeded, draws):
            out[rows[j]] = tok
    for j, i in enumerate(rows):
        gen = states[i].generator
        if gen is not None:
            out[i] = int(torch.multinomial(probs[j], 1, generator=gen))
    return out
