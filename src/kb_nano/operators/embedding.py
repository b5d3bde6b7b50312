"""``embedding`` baseline (vLLM ``VocabParallelEmbedding``), per TP rank.

vLLM pads the vocabulary to a multiple of 64 and gives each TP rank a contiguous shard
of rows; a rank looks up the token ids inside its shard, writes zeros for the others,
and an all-reduce sums the ranks. kb-nano measures one rank (rank 0) without the
all-reduce: ``vllm/model_executor/layers/vocab_parallel_embedding.py``
(``get_masked_input_and_mask``, ``forward_native``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kb_nano.operators.base import Operator, element_size, randint, shard

PADDING_SIZE = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE


def pad_vocab_size(vocab_size: int, pad_to: int = PADDING_SIZE) -> int:
    """Round the vocabulary up to a multiple of ``pad_to`` (vLLM ``pad_vocab_size``)."""
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    """Token embedding of one TP rank.

    Args:
        num_embeddings: vocabulary size of the model (unpadded).
        embedding_dim: hidden size.
        tp_size, tp_rank: the rank this module stands for (kb-nano addition: vLLM reads
            them from its distributed state).
    Forward: input_ ``[num_tokens]`` int64 ids in ``[0, num_embeddings)``.
    Returns ``[num_tokens, embedding_dim]`` in the weight dtype; rows of ids outside this
    rank's shard are zero.
    State dict: ``weight`` ``[pad_vocab_size(num_embeddings) / tp_size, embedding_dim]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        padded = pad_vocab_size(num_embeddings)
        self.num_embeddings_per_partition = padded // tp_size
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        nn.init.uniform_(self.weight, -1.0, 1.0)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        vocab_mask = (input_ >= self.vocab_start_index) & (input_ < self.vocab_end_index)
        masked_input = vocab_mask * (input_ - self.vocab_start_index)
        output = F.embedding(masked_input.long(), self.weight)
        return output.masked_fill_(~vocab_mask.unsqueeze(-1), 0)


def _init_args(facts: dict, tp: int) -> dict:
    # vLLM splits the padded vocabulary evenly (``vocab_range_from_global_vocab_size``
    # asserts divisibility); a TP that does not divide it is not a valid deployment.
    shard(pad_vocab_size(facts["vocab_size"]), tp, "padded vocab_size")
    width = facts.get("embedding_dim") or facts["hidden_size"]  # the module's own (OPT: narrower)
    return {"num_embeddings": facts["vocab_size"], "embedding_dim": width, "tp_size": tp, "tp_rank": 0}


def _inputs(args, facts, tp, num_tokens, dtype):
    return [randint("input_", [num_tokens], 0, args["num_embeddings"])]


def _traffic(args, inputs, dtype):
    n = inputs[0]["shape"][0]
    # ids in, one row read and written per token (upper bound at tp=1).
    es = element_size(dtype)
    return n * 8 + 2 * n * args["embedding_dim"] * es, 0


OPERATORS = {
    "embedding": Operator(
        name="embedding",
        level=1,
        category="embedding",
        baseline=VocabParallelEmbedding,
        init_args=_init_args,
        inputs=_inputs,
        traffic=_traffic,
        used_in="model.embed_tokens",
        reads_module_tree=True,  # (the embedding's own width)
    ),
}
