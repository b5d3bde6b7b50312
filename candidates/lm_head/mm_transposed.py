"""lm_head logits through ``torch.mm(hidden, weight.t())`` (a plain GEMM on the transposed
view; ``torch.addmm`` with the output bias where the model has one) instead of
``F.linear``; on CPU this takes a different BLAS path."""

import torch
from torch import nn

from kb_nano.operators.embedding import pad_vocab_size


class MmLMHead(nn.Module):
    """Same constructor, forward and state_dict (``weight``, ``bias`` when ``bias``) as
    kb_nano's ParallelLMHead.

    Forward: hidden_states ``[N, hidden]`` -> this rank's logits ``[N, padded_vocab / tp]``.
    """

    supported_semantics = ("bias",)

    def __init__(
        self,
        num_embeddings,
        embedding_dim,
        bias=False,
        params_dtype=None,
        org_num_embeddings=None,
        padding_size=64,
        quant_config=None,
        prefix="",
        tp_size=1,
        tp_rank=0,
    ) -> None:
        super().__init__()
        dtype = getattr(torch, params_dtype) if isinstance(params_dtype, str) else (params_dtype or torch.float32)
        rows = pad_vocab_size(num_embeddings, padding_size) // tp_size
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype)) if bias else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return torch.addmm(self.bias, hidden_states, self.weight.t())
        return torch.mm(hidden_states, self.weight.t())
