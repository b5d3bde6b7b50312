"""``rotary_embedding`` baseline (vLLM ``RotaryEmbedding`` / ``Llama3RotaryEmbedding``).

The cos/sin cache and the rotation follow vLLM ``RotaryEmbedding._compute_cos_sin_cache``
and ``forward_native``; llama3 frequency scaling follows vLLM
``Llama3RotaryEmbedding._compute_inv_freq`` (the same formula as transformers
``_compute_llama3_parameters``). Tests check both against transformers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kb_nano.operators.base import (
    DTYPES,
    TOLERANCES,
    NotApplicable,
    Operator,
    element_size,
    kv_heads_per_rank,
    normal,
    randint,
    shard,
)

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, rotary_dim]`` by ``cos``/``sin``
    ``[num_tokens, rotary_dim / 2]`` (vLLM ``_apply_rotary_emb_torch``)."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding applied to query and key, with vLLM's signature.

    Args:
        head_size: head_dim of the model.
        rotary_dim: rotated part of each head (``head_dim * partial_rotary_factor``).
        max_position_embeddings: rows of the cos/sin cache.
        base: ``rope_theta``.
        is_neox_style: rotate halves (True, Llama/Qwen/Mistral) or interleaved pairs.
        dtype: dtype of the cos/sin cache (the model dtype), ``torch.dtype`` or its name.
        rope_scaling: the model's ``rope_parameters`` when scaled; ``rope_type`` ``llama3``
            uses ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
            ``original_max_position_embeddings`` (kb-nano addition: vLLM selects the
            ``Llama3RotaryEmbedding`` subclass instead).
    Forward:
        positions: ``[num_tokens]`` int64; query ``[num_tokens, num_heads * head_size]``;
        key ``[num_tokens, num_kv_heads * head_size]`` or None.
    Returns ``(query, key)`` rotated, same shapes and dtypes.
    Buffers: ``cos_sin_cache`` ``[max_position_embeddings, rotary_dim]`` (non-persistent).
    Raises ``ValueError`` for an unsupported ``rope_type``.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
        dtype: torch.dtype | str | None = None,
        rope_scaling: dict | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.rope_scaling = dict(rope_scaling or {})
        dtype = DTYPES[dtype] if isinstance(dtype, str) else (dtype or torch.get_default_dtype())
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache().to(dtype), persistent=False)

    def _compute_inv_freq(self) -> torch.Tensor:
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type == "default":
            return inv_freq
        if rope_type != "llama3":
            raise ValueError(f"rope_type {rope_type!r} not supported; supported: {SUPPORTED_ROPE_TYPES}")
        factor = self.rope_scaling["factor"]
        low = self.rope_scaling["low_freq_factor"]
        high = self.rope_scaling["high_freq_factor"]
        orig = self.rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = orig / low
        high_freq_wavelen = orig / high
        wave_len = 2 * math.pi / inv_freq
        smooth = (orig / wave_len - low) / (high - low) if low != high else 0
        return torch.where(
            wave_len < high_freq_wavelen,
            inv_freq,
            torch.where(
                wave_len > low_freq_wavelen,
                inv_freq / factor,
                (1 - smooth) * inv_freq / factor + smooth * inv_freq,
            ),
        )

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq()
        t = torch.arange(self.max_position_embeddings, dtype=torch.float)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        positions = positions.flatten()
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        query = self._rotate(query, cos, sin, num_tokens)
        if key is not None:
            key = self._rotate(key, cos, sin, num_tokens)
        return query, key

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_tokens: int) -> torch.Tensor:
        shape = x.shape
        x = x.view(num_tokens, -1, self.head_size)
        x_rot = apply_rotary_emb(x[..., : self.rotary_dim], cos, sin, self.is_neox_style)
        return torch.cat((x_rot, x[..., self.rotary_dim :]), dim=-1).reshape(shape)


def _init_args(facts: dict, tp: int) -> dict:
    shard(facts["num_attention_heads"], tp, "num_attention_heads")
    kv_heads_per_rank(facts["num_key_value_heads"], tp)
    rope = dict(facts["rope"])
    if "rope_theta" not in rope:  # transformers' per-layer-type parameters (Gemma-3: full and sliding layers)
        raise NotApplicable(
            f"not covered: rope parameters per layer type ({', '.join(sorted(set(rope) - {'rope_type'}))})"
        )
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotApplicable(
            f"not covered: rope_type {rope_type!r} is not implemented by the baseline ({SUPPORTED_ROPE_TYPES})"
        )
    turn = facts.get("rotary")  # the model's own rotation (module tree)
    if turn is not None and not turn["neox"]:
        raise NotApplicable(f"not covered: {turn['module']} rotates q and k its own way (no rotate_half)")
    head_dim = facts["head_dim"]
    return {
        "head_size": head_dim,
        "rotary_dim": int(head_dim * facts["partial_rotary_factor"]),
        "max_position_embeddings": facts["max_position_embeddings"],
        "base": float(rope["rope_theta"]),
        "is_neox_style": True,
        "dtype": facts["dtype"],
        "rope_scaling": None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
    }


def _inputs(args, facts, tp, num_tokens, dtype):
    heads = facts["num_attention_heads"] // tp
    kv = kv_heads_per_rank(facts["num_key_value_heads"], tp)
    d = args["head_size"]
    return [
        randint("positions", [num_tokens], 0, args["max_position_embeddings"]),
        normal("query", [num_tokens, heads * d], dtype),
        normal("key", [num_tokens, kv * d], dtype),
    ]


def _traffic(args, inputs, dtype):
    positions, q, k = inputs
    n = positions["shape"][0]
    es = element_size(q["dtype"])
    qk = q["shape"][1] + k["shape"][1]
    rotated = n * qk * args["rotary_dim"] // args["head_size"]
    return 2 * n * qk * es + n * 8 + n * args["rotary_dim"] * es, 3 * rotated


OPERATORS = {
    "rotary_embedding": Operator(
        name="rotary_embedding",
        level=1,
        category="positional",
        baseline=RotaryEmbedding,
        init_args=_init_args,
        inputs=_inputs,
        traffic=_traffic,
        used_in="layers.*.self_attn.rotary_emb (on q and k after qkv_proj)",
        mutable_inputs=("query", "key"),  # vLLM's rotary_embedding rotates them in place
        tolerance=dict(TOLERANCES["rotary"]),
        reads_module_tree=True,
    ),
}
