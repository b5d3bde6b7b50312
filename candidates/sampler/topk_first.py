"""Top-k / top-p sampling that never sorts the whole vocabulary: ``torch.topk`` of the
batch's largest k (every token outside a row's top-k is masked anyway), top-p on those
sorted candidates, the exponential race among them, indices mapped back to token ids.
The idea of vLLM's ``apply_top_k_only`` / FlashInfer's top-k-first samplers.

Exact for any k, p: tokens outside the top-k get probability 0 in the baseline, so the
top-p mass, the probabilities and the argmax of ``probs / q`` are computed over the same
tokens (up to the float32 rounding of the softmax normaliser); equal logits are kept
together at the top-k and the top-p cut, as the baseline keeps them.
"""

import torch
from torch import nn


class TopKFirstSampler(nn.Module):
    """Same constructor and forward as kb_nano's TopKTopPSampler.

    Forward: logits ``[N, V]`` float32, q ``[N, V]`` float32 (Exp(1) noise), k ``[N]`` int,
    p ``[N]`` float -> token ids ``[N]`` int64.
    """

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        super().__init__()
        self.logprobs_mode = logprobs_mode

    def forward(self, logits, q, k=None, p=None):
        if k is None:  # nothing to prune: fall back to a full descending sort
            kmax = logits.shape[-1]
        else:
            kmax = int(k.max())
        vals, idx = logits.topk(kmax, dim=-1, sorted=True)  # descending
        if k is not None:
            # keep values >= each row's k-th largest (ties kept, as the baseline does)
            kth = vals.gather(1, (k.to(torch.long) - 1).unsqueeze(1))
            tied = int((logits >= kth).sum(dim=-1).max())  # equals of the k-th beyond kmax
            if tied > kmax:
                vals, idx = logits.topk(tied, dim=-1, sorted=True)
            vals = vals.masked_fill(vals < kth, float("-inf"))
        if p is not None:
            # ascending cumulative mass, as the baseline: drop the low tail whose mass <= 1 - p
            asc = vals.flip(-1)
            mass = asc.softmax(dim=-1).cumsum(dim=-1)
            drop = mass <= 1 - p.unsqueeze(1)
            drop[:, -1] = False
            cut = asc.masked_fill(drop, float("inf")).amin(dim=1, keepdim=True)  # keep equals of a kept logit
            vals = asc.masked_fill(asc < cut, float("-inf")).flip(-1)
        probs = vals.softmax(dim=-1, dtype=torch.float32)
        choice = probs.div_(q.gather(1, idx)).argmax(dim=-1, keepdim=True)
        return idx.gather(1, choice).view(-1)
