"""rotary_embedding in the transformers formulation: full-width cos/sin and
``x * cos + rotate_half(x) * sin`` in float32, one cast at the end (neox style)."""

import torch

from kb_nano.operators.rotary import RotaryEmbedding


class RotateHalfRotaryEmbedding(RotaryEmbedding):
    """Same constructor and forward as kb_nano's RotaryEmbedding baseline; reuses its
    cos/sin cache (``cos_sin_cache``, non-persistent)."""

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        cos, sin = self.cos_sin_cache.index_select(0, positions.flatten()).float().chunk(2, dim=-1)
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
        return self._rotate_full(query, cos, sin), (None if key is None else self._rotate_full(key, cos, sin))

    def _rotate_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.view(shape[0], -1, self.head_size)
        rot = x[..., : self.rotary_dim].float()
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = (rot * cos + rotated * sin).to(dtype)
        return torch.cat((out, x[..., self.rotary_dim :]), dim=-1).reshape(shape)
