"""How closely a quantized (or otherwise changed) causal LM follows its reference: teacher-forced logits and top-1
agreement along the same token sequences (``bench/bench_quant.py``, the weight-only tests)."""

from __future__ import annotations

import torch
from torch import nn


# ----------------------------------------------------------------------------------------- accuracy
@torch.inference_mode()
def sequence_logits(model: nn.Module, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Float32 logits ``[len(seq), vocab]`` of ``model`` over each whole sequence (sequences of one length
    share a forward pass: no padding, so no attention mask is involved)."""
    out: dict[int, torch.Tensor] = {}
    by_len: dict[int, list[int]] = {}
    for i, seq in enumerate(sequences):
        by_len.setdefault(len(seq), []).append(i)
    for idx in by_len.values():
        logits = model(input_ids=torch.tensor([sequences[i] for i in idx], dtype=torch.long)).logits.float()
        out.update({i: logits[j] for j, i in enumerate(idx)})
    return [out[i] for i in range(len(sequences))]


@torch.inference_mode()
def logit_agreement(reference: nn.Module | list[torch.Tensor], candidate: nn.Module,
                    sequences: list[list[int]]) -> dict[str, float]:
    """Teacher-forced comparison of two causal LMs along the same token sequences.

    Both models run each whole sequence in one forward pass; at every position the argmax of their logits
    is compared (the token greedy decoding would pick next, given the same history).

    Args:
        reference: e.g. the fp32 model, or its :func:`sequence_logits` over ``sequences`` (computed once
            when several candidates are compared).
        candidate: e.g. its quantized copy (same vocabulary).
        sequences: token id lists (each at least one token).

    Returns:
        ``positions``; ``top1_agreement`` (fraction of positions whose argmax agrees); ``max_abs_err`` and
        ``mean_abs_err`` of the logits; ``rel_err`` = ‖cand − ref‖ / ‖ref‖ (Frobenius, over all logits);
        ``mean_ref_top2_margin``: the reference's mean top-1 minus top-2 logit (small margins, as random
        weights give, make top-1 flips easy).
    """
    refs = reference if isinstance(reference, list) else sequence_logits(reference, sequences)
    cands = sequence_logits(candidate, sequences)
    agree = positions = count = 0
    max_abs = sum_abs = sq_err = sq_ref = margin = 0.0
    for ref, cand in zip(refs, cands):
        agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        positions += ref.shape[0]
        diff = cand.sub_(ref).flatten()  # in place: [T, vocab] logits are large, temporaries cost
        sq_err += float(torch.dot(diff, diff))
        diff.abs_()
        max_abs = max(max_abs, float(diff.max()))
        sum_abs += float(diff.sum())
        count += diff.numel()
        sq_ref += float(torch.dot(ref.flatten(), ref.flatten()))
        top2 = ref.topk(2, dim=-1).values
        margin += float((top2[:, 0] - top2[:, 1]).sum())
    return {"positions": positions, "top1_agreement": agree / max(positions, 1), "max_abs_err": max_abs,
            "mean_abs_err": sum_abs / max(count, 1), "rel_err": (sq_err / sq_ref) ** 0.5 if sq_ref else 0.0,
            "mean_ref_top2_margin": margin / max(positions, 1)}
