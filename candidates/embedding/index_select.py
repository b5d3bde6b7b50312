"""embedding that gathers rows with ``index_select`` and zeroes out-of-shard rows with a
multiply by the mask instead of ``masked_fill_``."""

import torch

from kb_nano.operators.embedding import VocabParallelEmbedding


class IndexSelectEmbedding(VocabParallelEmbedding):
    """Same constructor, forward and state_dict (``weight``) as the baseline."""

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        local = input_ - self.vocab_start_index
        in_shard = (local >= 0) & (local < self.vocab_end_index - self.vocab_start_index)
        rows = self.weight.index_select(0, torch.where(in_shard, local, 0).flatten())
        return (rows * in_shard.flatten().unsqueeze(-1).to(rows.dtype)).view(*input_.shape, -1)
