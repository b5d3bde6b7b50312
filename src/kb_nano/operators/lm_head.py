"""``lm_head`` baseline (vLLM ``ParallelLMHead`` + ``LogitsProcessor._get_logits``), per TP rank.

vLLM's ``ParallelLMHead`` holds rank r's contiguous shard of the padded vocabulary (as
``VocabParallelEmbedding``: vocabulary padded to a multiple of 64, split evenly); the
``LogitsProcessor`` computes ``hidden_states @ weight^T`` on every rank and all-gathers
the shards. kb-nano measures one rank's GEMM (rank 0), without the gather, the slice to
the unpadded vocabulary and Gemma-2's final soft-capping (all in ``LogitsProcessor``).
The reference is the model's ``lm_head`` ``nn.Linear(hidden, vocab)`` (tied to
``embed_tokens`` in Llama-3.2-1B and Gemma-2; the GEMM is the same), with its output bias
where the model's module tree has one (Phi-3.5-MoE's ``lm_head_bias``: semantics ``bias``).

Traffic: minimum DRAM bytes = the weight shard + hidden states + logits once; FLOPs =
``2 * N * hidden * vocab_padded / tp`` (the 2·M·N·K GEMM count).

Tolerance: class ``gemm``: one fp32-accumulated dot product over ``hidden`` terms, rounded
once, so bf16 atol/rtol 1e-2 (one output ulp is <= 2^-7 relative); fp32 1e-4 (free
reduction order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kb_nano.operators.base import (
    DTYPES,
    TOLERANCES,
    Operator,
    element_size,
    normal,
    shard,
)
from kb_nano.operators.embedding import PADDING_SIZE, pad_vocab_size


class ParallelLMHead(nn.Module):
    """Output projection of one TP rank with vLLM's ``ParallelLMHead`` signature.

    Args:
        num_embeddings: vocabulary size (unpadded).
        embedding_dim: hidden size.
        bias: an output bias ``[padded_vocab / tp_size]`` (Phi-3.5-MoE; drawn from N(0, 1)
            on real rows, so a candidate that leaves it out fails).
        params_dtype: weight dtype (torch dtype or its name; default float32).
        org_num_embeddings, quant_config, prefix: vLLM signature (LoRA vocab / quantisation
            are not supported: must be None / equal to num_embeddings).
        padding_size: vocabulary padding multiple (vLLM ``DEFAULT_VOCAB_PADDING_SIZE`` 64).
        tp_size, tp_rank: the rank this module stands for (kb-nano addition).
    Forward (vLLM's ``ParallelLMHead.forward`` raises; this is ``LogitsProcessor._get_logits``
    before the gather): hidden_states ``[N, embedding_dim]``.
    Returns this rank's logits ``[N, padded_vocab / tp_size]`` in the weight dtype.
    State dict: ``weight`` ``[padded_vocab / tp_size, embedding_dim]`` (rows of padding ids are
    zero, as vLLM's weight loader leaves them), and ``bias`` when ``bias``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        params_dtype: torch.dtype | str | None = None,
        org_num_embeddings: int | None = None,
        padding_size: int = PADDING_SIZE,
        quant_config=None,
        prefix: str = "",
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        super().__init__()
        if quant_config is not None or (org_num_embeddings not in (None, num_embeddings)):
            raise ValueError("quantized or LoRA-extended lm_head is not supported by the baseline")
        dtype = DTYPES[params_dtype] if isinstance(params_dtype, str) else (params_dtype or torch.float32)
        padded = pad_vocab_size(num_embeddings, padding_size)
        self.num_embeddings_per_partition = padded // tp_size
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype))
        # std 1/sqrt(hidden): logits of order 1 for inputs of order 1 (the final RMSNorm output).
        nn.init.normal_(self.weight, std=embedding_dim**-0.5)
        real = max(0, min(num_embeddings - self.vocab_start_index, self.num_embeddings_per_partition))
        with torch.no_grad():
            self.weight[real:].zero_()
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, dtype=dtype))
            with torch.no_grad():
                nn.init.normal_(self.bias[:real])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight, self.bias)


def _init_args(facts: dict, tp: int) -> dict:
    shard(pad_vocab_size(facts["vocab_size"]), tp, "padded vocab_size")
    return {
        "num_embeddings": facts["vocab_size"],
        "embedding_dim": facts.get("lm_head_in") or facts["hidden_size"],  # the module's own (OPT: narrower)
        "params_dtype": facts["dtype"],
        "tp_size": tp,
        "tp_rank": 0,
        **({"bias": True} if facts.get("lm_head_bias") else {}),
    }


def _inputs(args, facts, tp, num_tokens, dtype):
    return [normal("hidden_states", [num_tokens, args["embedding_dim"]], dtype)]


def _traffic(args, inputs, dtype):
    n, h = inputs[0]["shape"]
    es = element_size(inputs[0]["dtype"])
    v = pad_vocab_size(args["num_embeddings"]) // args["tp_size"]
    return v * h * element_size(args["params_dtype"]) + n * h * es + n * v * es, 2 * n * h * v


OPERATORS = {
    "lm_head": Operator(
        name="lm_head",
        level=1,
        category="embedding",
        baseline=ParallelLMHead,
        init_args=_init_args,
        inputs=_inputs,
        traffic=_traffic,
        used_in="lm_head (LogitsProcessor: logits = hidden_states @ lm_head.weight^T, before the all-gather)",
        tolerance=dict(TOLERANCES["gemm"]),
        semantics=lambda facts: "bias" if facts.get("lm_head_bias") else "",
        reads_module_tree=True,
    ),
}
