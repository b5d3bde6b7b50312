"""``sampler`` baseline (vLLM ``TopKTopPSampler.forward_native``), deterministic.

vLLM ``apply_top_k_top_p``: sort the logits ascending; top-k keeps the values >= the k-th
largest; top-p keeps the smallest set of largest tokens whose probability reaches p
(``cumsum(softmax(sorted)) <= 1 - p`` is masked, the largest token always stays); masked
logits become ``-inf`` and are scattered back. One departure: where tokens with equal
logits straddle the top-p cut, vLLM's (and transformers') result depends on the order
the sort gave the equal values; the baseline keeps every token whose logit equals one
kept (as threshold-based samplers do), a result no sort order changes. Random float32
logits have no such ties; the golden logits (bf16 values) have many. Then ``probs = softmax(logits, fp32)`` and
``random_sample``: ``probs.div_(q).argmax(-1)`` with ``q ~ Exp(1)`` (the exponential race,
equal in law to sampling from probs). vLLM draws q inside; here q is an input so that the
output is deterministic and candidates are compared exactly (int64 token ids).
The reference is transformers' ``TopKLogitsWarper`` followed by ``TopPLogitsWarper``
(same masks), softmax, and the same ``argmax(probs / q)``.

Shapes: the sampler sees the full (gathered, unpadded) vocabulary on every rank, so its
scenario is the same at every TP. Logits are float32 (vLLM's ``Sampler`` casts them).
Per-request ``k`` (int32, in [1, 64]) and ``p`` (float32, in [0.5, 1)).

Traffic: minimum DRAM bytes = logits and q read once, k/p read, ids written; FLOPs =
8 per logit (the elementwise passes of ``forward_native``: top-p softmax 3, cumsum 1,
final softmax 3, division 1; the O(V log V) sort is not counted).

Tolerance: class ``exact``: token ids must be equal.
"""

from __future__ import annotations

import torch
from torch import nn

from kb_nano.operators.base import (
    TOLERANCES,
    Operator,
    exponential,
    normal,
    randint,
    uniform,
)

MAX_TOP_K = 64
LOGIT_STD = 3.0


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k / top-p set with ``-inf`` (vLLM
    ``apply_top_k_top_p``, sort-based). ``logits`` ``[N, V]``; ``k`` ``[N]`` int; ``p`` ``[N]``."""
    if k is None and p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        top_k_mask = logits_sort.size(1) - k.to(torch.long)
        top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
        top_k_mask = logits_sort < top_k_mask
        logits_sort.masked_fill_(top_k_mask, -float("inf"))
    if p is not None:
        probs_sort = logits_sort.softmax(dim=-1)
        probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
        top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
        top_p_mask[:, -1] = False
        # the smallest kept logit (the same for any order of equal values): keep all its equals
        cut = logits_sort.masked_fill(top_p_mask, float("inf")).amin(dim=1, keepdim=True)
        logits_sort.masked_fill_(logits_sort < cut, -float("inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


class TopKTopPSampler(nn.Module):
    """Top-k / top-p sampling with vLLM's ``TopKTopPSampler`` signature.

    Args: logprobs_mode: vLLM signature (processed logits are not returned here).
    Forward: logits ``[N, vocab]`` float32; q ``[N, vocab]`` float32 exponential noise (takes
    the place of vLLM's ``generators``); k ``[N]`` int (top-k per request) or None;
    p ``[N]`` float (top-p per request) or None.
    Returns sampled token ids ``[N]`` int64. No parameters.
    """

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        super().__init__()
        self.logprobs_mode = logprobs_mode

    def forward(
        self, logits: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None = None, p: torch.Tensor | None = None
    ) -> torch.Tensor:
        logits = apply_top_k_top_p(logits, k, p)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        return probs.div_(q).argmax(dim=-1).view(-1)


def _init_args(facts: dict, tp: int) -> dict:
    return {}


def _inputs(args, facts, tp, num_tokens, dtype):
    v = facts["vocab_size"]
    return [
        normal("logits", [num_tokens, v], "float32", std=LOGIT_STD),
        exponential("q", [num_tokens, v], "float32"),
        randint("k", [num_tokens], 1, MAX_TOP_K + 1, dtype="int32"),
        uniform("p", [num_tokens], 0.5, 1.0, dtype="float32"),
    ]


def _traffic(args, inputs, dtype):
    n, v = inputs[0]["shape"]
    return 2 * n * v * 4 + n * (4 + 4 + 8), 8 * n * v


OPERATORS = {
    "sampler": Operator(
        name="sampler",
        level=1,
        category="sampler",
        baseline=TopKTopPSampler,
        init_args=_init_args,
        inputs=_inputs,
        traffic=_traffic,
        used_in="sampler (after lm_head + logits all-gather: top-k/top-p mask, softmax, sample)",
        tolerance=dict(TOLERANCES["exact"]),
    ),
}
