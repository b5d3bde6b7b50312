"""``rotary_embedding`` baseline: vLLM's rotary embeddings with one constructor.

The cos/sin cache and the rotation follow vLLM ``RotaryEmbedding._compute_cos_sin_cache``
and ``forward_native``. ``rope_scaling["rope_type"]`` selects the frequencies and the
cos/sin scaling of the vLLM class ``get_rope`` builds for it (vLLM 0.32):

- ``llama3``: ``Llama3RotaryEmbedding._compute_inv_freq`` (transformers
  ``_compute_llama3_parameters``).
- ``linear``: ``LinearScalingRotaryEmbedding``: positions divided by ``factor``.
- ``dynamic``: ``DynamicNTKScalingRotaryEmbedding``: one cache, built once, with the base
  ``base * (factor * max_position_embeddings / max_trained_positions - (factor - 1)) **
  (rotary_dim / (rotary_dim - 2))``; ``max_trained_positions`` defaults to
  ``max_position_embeddings``, which leaves the base unscaled (transformers'
  ``_compute_dynamic_ntk_parameters`` does the same below ``max_position_embeddings``).
- ``yarn``: ``YaRNScalingRotaryEmbedding``: frequencies ramped between interpolation and
  extrapolation over the correction range of ``beta_fast``/``beta_slow`` (``truncate``),
  cos and sin multiplied by the attention factor (``attention_factor``, else the ratio of
  ``mscale``/``mscale_all_dim`` mscales, else ``0.1 * ln(factor) + 1``): transformers'
  ``_compute_yarn_parameters`` and its ``attention_scaling``.
- ``longrope``: ``Phi3LongRoPEScaledRotaryEmbedding``: frequencies divided by
  ``long_factor`` and cos/sin multiplied by ``long_mscale`` when the context length
  (``max_position_embeddings``, vLLM's default ``max_model_len``) exceeds
  ``original_max_position_embeddings``, for every position; ``short_factor`` and
  ``short_mscale`` otherwise. The mscale defaults to ``attention_factor`` (transformers),
  else ``sqrt(1 + ln(s) / ln(original))``, ``s = max_position_embeddings /
  original_max_position_embeddings`` (vLLM's ratio; transformers takes ``factor`` for
  ``s`` when the config has one). Tests check each against transformers' rotary modules.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from kb_nano.operators.base import (
    DTYPES,
    TOLERANCES,
    NotApplicable,
    Operator,
    config_field,
    element_size,
    kv_heads_per_rank,
    normal,
    randint,
    shard,
)

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")
# Largest cos/sin cache (max_position_embeddings x rotary_dim x the dtype's bytes) a scenario
# builds: 8 GiB, 3x Llama-4 Scout's (10485760 x 128 x 2 B = 2.5 GiB, the longest context of
# the vendored models). Each of the two workers builds its own copy (a non-persistent
# buffer), so a larger one would take most of a 23 GiB CPU host, or fail to allocate, and
# the failure would be the candidate's row; such a model's rotary_embedding is not covered.
ROTARY_CACHE_MAX_BYTES = 8 << 30


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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(nn.Module):
    """Rotary position embedding applied to query and key, with vLLM's signature.

    Args:
        head_size: head_dim of the model.
        rotary_dim: rotated part of each head (``head_dim * partial_rotary_factor``).
        max_position_embeddings: rows of the cos/sin cache (positions 0 .. this - 1).
        base: ``rope_theta``.
        is_neox_style: rotate halves (True, Llama/Qwen/Mistral) or interleaved pairs.
        dtype: dtype of the cos/sin cache (the model dtype), ``torch.dtype`` or its name.
        rope_scaling: the model's ``rope_parameters`` when scaled (kb-nano addition: vLLM
            selects a subclass per ``rope_type`` instead; see the module docstring).
            ``llama3``: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``. ``linear``: ``factor``. ``dynamic``:
            ``factor``, optional ``max_trained_positions``. ``yarn``: ``factor``,
            ``original_max_position_embeddings``, optional ``beta_fast`` (32),
            ``beta_slow`` (1), ``mscale``, ``mscale_all_dim``, ``attention_factor``,
            ``truncate`` (True). ``longrope``: ``short_factor``, ``long_factor``
            (``rotary_dim / 2`` numbers each), ``original_max_position_embeddings``,
            optional ``short_mscale``, ``long_mscale``. Other keys are ignored.
    Forward:
        positions: ``[num_tokens]`` int64 in ``[0, max_position_embeddings)``; query
        ``[num_tokens, num_heads * head_size]``; key ``[num_tokens, num_kv_heads * head_size]``
        or None.
    Returns ``(query, key)`` rotated, same shapes and dtypes.
    Buffers: ``cos_sin_cache`` ``[max_position_embeddings, rotary_dim]`` (non-persistent):
    cos then sin of each position's angles, times the rope type's attention scaling (vLLM's
    ``linear`` cache has ``max_position_embeddings * factor`` rows and its ``yarn`` cache
    ``original_max_position_embeddings * factor``: the same values for the rows both hold).
    Raises ``ValueError`` for an unsupported ``rope_type`` or a missing scaling field.
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
        self.rope_type = self.rope_scaling.get("rope_type", "default")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} not supported; supported: {SUPPORTED_ROPE_TYPES}")
        dtype = DTYPES[dtype] if isinstance(dtype, str) else (dtype or torch.get_default_dtype())
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(dtype), persistent=False)

    def _field(self, name: str):
        if self.rope_scaling.get(name) is None:
            raise ValueError(f"rope_scaling of rope_type {self.rope_type!r} needs {name!r}; got {self.rope_scaling}")
        return self.rope_scaling[name]

    def _base_inv_freq(self, base: float) -> torch.Tensor:
        return 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))

    def _compute_inv_freq(self) -> torch.Tensor:
        """The ``[rotary_dim / 2]`` float32 inverse frequencies of this rope type."""
        kind = self.rope_type
        if kind in ("default", "linear"):  # linear scales the positions (vLLM), not these
            return self._base_inv_freq(self.base)
        if kind == "llama3":
            return self._llama3_inv_freq()
        if kind == "dynamic":
            factor = self._field("factor")
            trained = self.rope_scaling.get("max_trained_positions") or self.max_position_embeddings
            d = self.rotary_dim
            base = self.base * ((factor * self.max_position_embeddings / trained) - (factor - 1)) ** (d / (d - 2))
            return self._base_inv_freq(base)
        if kind == "yarn":
            return self._yarn_inv_freq()
        factors = self._field("long_factor" if self._long_rope() else "short_factor")
        if len(factors) != self.rotary_dim // 2:
            raise ValueError(f"longrope factors have {len(factors)} numbers; rotary_dim {self.rotary_dim} needs half")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * self.base ** self._exponents())

    def _exponents(self) -> torch.Tensor:
        return torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim

    def _llama3_inv_freq(self) -> torch.Tensor:
        inv_freq = self._base_inv_freq(self.base)
        factor = self._field("factor")
        low = self._field("low_freq_factor")
        high = self._field("high_freq_factor")
        orig = self._field("original_max_position_embeddings")
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

    def _yarn_inv_freq(self) -> torch.Tensor:
        factor = self._field("factor")
        orig = self._field("original_max_position_embeddings")
        beta_fast = self.rope_scaling.get("beta_fast") or 32
        beta_slow = self.rope_scaling.get("beta_slow") or 1
        d, base = self.rotary_dim, self.base

        def correction_dim(rotations: float) -> float:
            return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.rope_scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float) - low) / (high - low), 0, 1)
        pos_freqs = base ** self._exponents()
        extrapolation = 1 - ramp
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation

    def _long_rope(self) -> bool:
        return self.max_position_embeddings > self._field("original_max_position_embeddings")

    def attention_scaling(self) -> float:
        """The factor the cos/sin cache is multiplied by (transformers' ``attention_scaling``):
        1 except for ``yarn`` and ``longrope``."""
        if self.rope_type == "yarn":
            factor = self._field("factor")
            if self.rope_scaling.get("attention_factor") is not None:
                return float(self.rope_scaling["attention_factor"])
            mscale, all_dim = self.rope_scaling.get("mscale"), self.rope_scaling.get("mscale_all_dim")
            if mscale and all_dim:
                return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim))
            return float(yarn_mscale(factor))
        if self.rope_type == "longrope":
            chosen = self.rope_scaling.get("long_mscale" if self._long_rope() else "short_mscale")
            if chosen is None:  # transformers' explicit factor (_compute_longrope_parameters)
                chosen = self.rope_scaling.get("attention_factor")
            if chosen is not None:
                return float(chosen)
            orig = self._field("original_max_position_embeddings")
            scale = self.max_position_embeddings / orig
            return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(orig))
        return 1.0

    def _compute_cos_sin_cache(self, dtype: torch.dtype, rows: int = 1 << 16) -> torch.Tensor:
        """``[max_position_embeddings, rotary_dim]`` in ``dtype``: cos then sin of each
        position's angles, computed in float32 (vLLM ``_compute_cos_sin_cache``, then
        ``.to(dtype)``) ``rows`` positions at a time, so that a long context (Llama-4
        Scout: 10485760 positions) needs the cache plus one chunk, not four float32 copies
        of it; every element is the same as computed in one piece."""
        inv_freq = self._compute_inv_freq()
        scaling = self.attention_scaling()
        cache = torch.empty(self.max_position_embeddings, self.rotary_dim, dtype=dtype)
        for start in range(0, self.max_position_embeddings, rows):
            t = torch.arange(start, min(start + rows, self.max_position_embeddings), dtype=torch.float)
            if self.rope_type == "linear":
                t = t / self._field("factor")
            freqs = torch.einsum("i,j -> ij", t, inv_freq)
            cos, sin = freqs.cos(), freqs.sin()
            if scaling != 1.0:
                cos, sin = cos * scaling, sin * scaling
            cache[start : start + len(t)] = torch.cat((cos, sin), dim=-1)
        return cache

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


def _layer_kinds(facts: dict) -> list[tuple[str, dict]]:
    """One kind per layer type when the model's ``rope_parameters`` are per layer type
    (transformers 5 keys them by the ``layer_types`` entries: Gemma-3's
    ``sliding_attention`` and ``full_attention``, each with its own ``rope_theta`` and
    ``rope_type``), named as ``attention`` names its kinds (``sliding<W>``, ``full``), each
    with that type's parameters as its ``rope``; one kind otherwise."""
    rope = facts.get("rope") or {}
    if "rope_theta" in rope:
        return [("", {})]
    order = list(dict.fromkeys(config_field(facts, "layer_types") or [])) + sorted(rope)
    types = [t for t in dict.fromkeys(order) if isinstance(rope.get(t), dict)]
    if not types:
        return [("", {})]  # (_init_args says why not covered)
    window = config_field(facts, "sliding_window")

    def name(layer_type: str) -> str:
        if "sliding" in layer_type:
            return f"sliding{window}" if window else "sliding"
        return "full" if layer_type == "full_attention" else layer_type

    return [(name(t), {"rope": rope[t]}) for t in types]


def _no_theta_reason(facts: dict, rope: dict) -> str:
    """Why a rope without ``rope_theta`` is not covered: parameters per layer type not split by
    :func:`_layer_kinds`, or none though the model builds a rotary module (NoPE layers)."""
    if types := sorted(k for k, v in rope.items() if isinstance(v, dict)):
        return f"not covered: rope parameters per layer type ({', '.join(types)})"
    switch = re.compile(r"nope|no_rope|use_rope|position_embedding_type")  # (SmolLM3's no_rope_layers)
    said = ", ".join(f"{k}={v!r}" for k, v in sorted((facts.get("hf_config") or {}).items()) if switch.search(k))
    return "not covered: the config has no rope parameters (no rope_theta), though the model builds a rotary " + (
        f"module: NoPE layers ({said})" if said else "module: its layers apply no RoPE the config describes (NoPE)"
    )


def _init_args(facts: dict, tp: int) -> dict:
    shard(facts["num_attention_heads"], tp, "num_attention_heads")
    kv_heads_per_rank(facts["num_key_value_heads"], tp)
    if facts.get("rotary_module") is False:  # (module tree: read() found no rotary_emb module)
        raise NotApplicable(
            "not covered: the model has no rotary_emb module (it applies no RoPE, or applies it in a way "
            "kb-nano does not read)"
        )
    rope = dict(facts["rope"])
    if "rope_theta" not in rope:
        raise NotApplicable(_no_theta_reason(facts, rope))
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotApplicable(
            f"not covered: rope_type {rope_type!r} is not implemented by the baseline ({SUPPORTED_ROPE_TYPES})"
        )
    turn = facts.get("rotary")  # the model's own rotation (module tree)
    if turn is not None and turn.get("reason"):
        raise NotApplicable(turn["reason"])
    neox = turn is None or turn["neox"]
    head_dim = facts["head_dim"]
    # a layer type's own factor (Laguna, Zaya: in rope_parameters[layer_type]) before the model's
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor") or facts["partial_rotary_factor"]))
    if turn is not None and turn.get("head_size"):  # MLA: the rope slice of each head is all that turns
        head_dim = rotary_dim = turn["head_size"]
    if not facts.get("max_position_embeddings"):
        raise NotApplicable("not covered: the config has no max_position_embeddings (the cos/sin cache's length)")
    positions = int(facts["max_position_embeddings"])
    cache_bytes = positions * rotary_dim * element_size(facts["dtype"])
    if cache_bytes > ROTARY_CACHE_MAX_BYTES:
        raise NotApplicable(
            f"not covered: the cos/sin cache of max_position_embeddings={positions} x rotary_dim={rotary_dim} in "
            f"{facts['dtype']} is {cache_bytes / 2**30:.4g} GiB, above the {ROTARY_CACHE_MAX_BYTES >> 30} GiB "
            "kb-nano builds (kb_nano.operators.rotary.ROTARY_CACHE_MAX_BYTES)"
        )
    return {
        "head_size": head_dim,
        "rotary_dim": rotary_dim,
        "max_position_embeddings": facts["max_position_embeddings"],
        "base": float(rope["rope_theta"]),
        "is_neox_style": neox,
        "dtype": facts["dtype"],
        "rope_scaling": None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
    }


def _semantics(facts: dict) -> str:
    """``interleaved`` when the model's attention rotates interleaved pairs (the module
    tree's ``rotary`` with ``neox`` False and no reason: Llama-4), else ``""``."""
    turn = facts.get("rotary")
    return "interleaved" if turn is not None and not turn["neox"] and not turn.get("reason") else ""


def _inputs(args, facts, tp, num_tokens, dtype):
    """positions ``[N]`` and the rank's query ``[N, heads * head_size]`` and key ``[N,
    kv_heads * head_size]``; with multi-head latent attention (the module tree's ``rotary``
    with ``shared_key``: DeepSeek-V3) the query is each head's rope slice and the key is the
    one rope head all heads share (vLLM's ``q_pe`` and ``k_pe``), ``[N, head_size]`` at
    every TP."""
    heads = facts["num_attention_heads"] // tp
    shared = (facts.get("rotary") or {}).get("shared_key")
    kv = 1 if shared else kv_heads_per_rank(facts["num_key_value_heads"], tp)
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
        layer_kinds=_layer_kinds,
        semantics=_semantics,
    ),
}
