"""L3 ``decoder_layer`` and L4 ``model`` baselines: the transformers classes themselves.

Both baselines are thin wrappers that build the transformers module of the model's
architecture (``AutoModelForCausalLM.from_config`` on the meta device, so nothing is
allocated twice) from the model's ``config.json`` fields, give it real seeded random
weights with transformers' own ``_init_weights`` (``normal(0, initializer_range)`` for
linear/embedding weights, ones for norms; the Tier-1 engine (:mod:`kb_nano.kernels.worker`) later perturbs the
constant ones), and call it. Candidates at these levels are therefore checked against the
reference implementation, not against a re-implementation of it.

Conventions shared by both:

- **Attention:** transformers' ``eager`` implementation (``eager_attention_forward``:
  matmul, additive mask, fp32 softmax, matmul) with its causal mask from
  ``masking_utils.create_causal_mask``. Input: one sequence of N tokens (prefill, no KV
  cache); token i attends to tokens 0..i. ``positions`` only set the rotary angles.
- **State dict:** the transformers keys (``self_attn.q_proj.weight``, ...;
  ``model.layers.0...``, ``lm_head.weight`` for the model): the wrapper registers the
  transformers module's children as its own, so a candidate must reproduce exactly these
  keys (``load_state_dict(strict=True)``), and the swapper (:mod:`kb_nano.e2e.swap`) can move
  weights between a transformers module and a candidate directly.
- **Rotary frequencies stay float32** under ``.to(dtype)``: transformers computes
  ``inv_freq`` in float32 and ``from_pretrained(dtype=bfloat16)`` keeps it so; a plain
  ``module.to(bfloat16)`` would round it (an angle error of hundreds of radians at
  position 10^5), so the wrappers recompute it after every ``_apply``.
- **TP:** ``decoder_layer`` at TP=k is one rank's shard, as vLLM splits the layer: the
  transformers class built with ``num_attention_heads/k``, ``num_key_value_heads/k``
  (replicated when k exceeds them), ``intermediate_size/k`` (and ``moe_intermediate_size/k``),
  same ``hidden_size`` and ``head_dim`` (:func:`shard_config`). The two all-reduces (after
  ``o_proj`` and ``down_proj``) are omitted, as the ``embedding`` operator omits its
  all-reduce: the scenario measures one rank's compute, and its output is that rank's
  partial layer, not the full layer. ``model`` is measured at TP=1 only.
"""

from __future__ import annotations

import inspect

import torch

from kb_nano.operators.base import (
    NotApplicable,
    Operator,
    config_field,
    element_size,
    normal,
    randint,
)
from kb_nano.operators.hf_modules import (
    ATTN_IMPLEMENTATION,
    _causal_mask,
    _materialize,
    _meta_causal_lm,
    _Wrapper,
    hf_config,
    model_config,
)

MODEL_NUM_LAYERS = 2  # layers of the L4 ``model`` scenario (the real config keeps everything else)
# Size limits (device-independent, so the manifest stays the same everywhere). They keep the
# embedded CPU default affordable: one bf16 call of a full Llama-3.1-8B layer takes ~110 ms
# at n=1 on one CPU core of the 2-core development machine, and n=64 costs ~4x more (tp 4:
# 24 -> 86 ms), x 220 calls per job. Scenarios above a limit are not applicable, with the
# limit named in the reason.
# decoder_layer: parameters of one per-rank layer (Llama-3.1-8B: 218e6 at tp 1, 55e6 at tp 4).
LAYER_MAX_PARAMS = 128_000_000
# model: parameters of the MODEL_NUM_LAYERS-layer model; the vocabulary stays real, and
# embedding + LM head alone are 1.05e9 (Llama-3.1-8B) to 1.24e9 (Qwen3-8B).
MODEL_MAX_PARAMS = 1_000_000_000

# Correctness tolerance (atol, rtol; torch.allclose semantics) of L3/L4 outputs. Calibrated
# against the reference itself: evaluated in float64 with the same weights and inputs, the
# bf16 transformers layer is off by up to 0.43 (Llama-3.1-8B, tp 1, n 64; 0.28 at tp 2,
# 0.14 at tp 4; Qwen3-8B tp 4: 0.05; Llama-3.2-1B: 0.05; the 2-layer Llama-3.2-1B model's
# logits: 0.08), the tail of a norm-wise error of ~1% (||err|| / ||ref|| = 0.006-0.013), and
# grows with the output scale. A candidate as accurate as the reference differs from it by
# up to the sum of two such errors (measured: 0.48 for decoder_layer/sdpa_fused at
# Llama-3.1-8B tp 1 n 64). Real bugs are far above (tp 4 n 64: rotary left out 4.7, no
# causal mask 5.0, norm weight ignored 2.2, Qwen3 q/k norm left out 2.3). fp16 has 3 more
# mantissa bits (1/8); fp32 is ~1e-5. The pointwise 1e-2 of L1 operators would fail the
# reference itself. A norm-wise criterion would separate better (kb_nano.kernels.compare does not
# have one).
LAYER_TOLERANCE = {"bfloat16": (0.5, 0.02), "float16": (0.08, 0.01), "float32": (1e-3, 1e-3)}


# --------------------------------------------------------------------------- L3


class DecoderLayer(_Wrapper):
    """One decoder layer of the architecture: the transformers class itself
    (``LlamaDecoderLayer``, ``Qwen3DecoderLayer``, ...), with its rotary embedding.

    Args:
        config: the model's config.json fields (a plain dict; ``model_type`` selects the class).
        layer_idx: which layer (matters only for per-layer types, e.g. sliding windows).
        tp_size: build one TP rank's shard (:func:`shard_config`; all-reduces omitted).
    Forward:
        hidden_states ``[num_tokens, hidden_size]``; positions ``[num_tokens]`` int64.
    Returns ``[num_tokens, hidden_size]``: the layer output (residual included), as
    transformers computes it for one sequence of num_tokens tokens, causal, no KV cache.
    State dict: the transformers layer's keys (``input_layernorm.weight``,
    ``self_attn.{q,k,v,o}_proj.weight``, ``mlp.{gate,up,down}_proj.weight``, ...).
    Attributes: ``hf_config`` (the per-rank transformers config), ``init_args`` (the
    constructor arguments, used by :mod:`kb_nano.e2e.swap`).

    Class attributes for subclasses (candidates): ``attn_implementation`` (transformers
    attention backend, default ``eager``); ``init_weights = False`` skips the random init
    for modules that always receive their weights through ``load_state_dict``.
    """

    attn_implementation = ATTN_IMPLEMENTATION
    init_weights = True

    def __init__(self, config: dict, layer_idx: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        cfg = hf_config(config, tp_size, int(layer_idx) + 1, self.attn_implementation)
        lm = _meta_causal_lm(cfg)
        decoder = lm.get_decoder()
        layer, rotary = decoder.layers[layer_idx], decoder.rotary_emb
        _materialize(lm, layer, self.init_weights)
        _materialize(lm, rotary, True)
        self.hf_config = cfg
        self.init_args = {"config": dict(config), "layer_idx": layer_idx, "tp_size": tp_size}
        self._adopt(layer.eval())
        self.rotary_emb = rotary  # non-persistent buffers only: not in the state dict
        # a rotary module with parameters per layer type (Gemma-3, Laguna) takes the layer's type
        types = getattr(cfg, "layer_types", None) or []
        takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
        self._rotary_kwargs = {"layer_type": types[layer_idx]} if takes_type and layer_idx < len(types) else {}

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = hidden_states.unsqueeze(0)
        position_ids = positions.reshape(1, -1)
        cos, sin = self.rotary_emb(x, position_ids, **self._rotary_kwargs)
        out = self._inner(
            x,
            attention_mask=_causal_mask(self.hf_config, x),
            position_ids=position_ids,
            position_embeddings=(cos, sin),
        )
        if isinstance(out, tuple):  # older transformers layers return (hidden_states, ...)
            out = out[0]
        return out[0]


# --------------------------------------------------------------------------- L4


class CausalLM(_Wrapper):
    """The architecture's transformers causal LM (``LlamaForCausalLM``, ...) with the real
    config except ``num_hidden_layers`` (embedding, final norm, LM head and vocabulary real).

    Args:
        config: the model's config.json fields (a plain dict).
        num_hidden_layers: layers kept (default :data:`MODEL_NUM_LAYERS`).
    Forward:
        input_ids ``[num_tokens]`` int64; positions ``[num_tokens]`` int64.
    Returns logits ``[num_tokens, vocab_size]`` in the weight dtype: one sequence, causal,
    no KV cache (the 4-D causal mask is passed explicitly, so ``positions`` only set the
    rotary angles).
    State dict: the transformers keys (``model.embed_tokens.weight``, ``model.layers.*``,
    ``model.norm.weight``, ``lm_head.weight``; tied models share the last with the first).
    Class attributes ``attn_implementation`` and ``init_weights`` as for :class:`DecoderLayer`.
    """

    attn_implementation = ATTN_IMPLEMENTATION
    init_weights = True

    def __init__(self, config: dict, num_hidden_layers: int = MODEL_NUM_LAYERS) -> None:
        super().__init__()
        cfg = hf_config(config, 1, num_hidden_layers, self.attn_implementation)
        lm = _meta_causal_lm(cfg)
        _materialize(lm, lm, self.init_weights)  # transformers' _init_weights on every module
        lm.tie_weights()
        self.hf_config = lm.config
        self.init_args = {"config": dict(config), "num_hidden_layers": num_hidden_layers}
        self._adopt(lm.eval())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(1, -1)
        weight = self._inner.get_input_embeddings().weight
        probe = weight.new_empty((1, ids.shape[1], 0))  # shape/dtype/device for the mask only
        out = self._inner(
            input_ids=ids,
            attention_mask=_causal_mask(self.hf_config, probe),
            position_ids=positions.reshape(1, -1),
            use_cache=False,
        )
        return out.logits[0]


# --------------------------------------------------------------------------- rules


def _check_sliding_window(config: dict, num_tokens: int) -> None:
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True) and num_tokens > int(window):
        raise NotApplicable(
            f"num_tokens={num_tokens} exceeds sliding_window={window}; the baseline uses the full causal mask"
        )


def _layer_init_args(facts: dict, tp: int) -> dict:
    config = model_config(facts)
    cfg = hf_config(config, tp, num_hidden_layers=1)  # raises NotApplicable for a TP that does not divide
    params = _param_counts(cfg)["layer"]
    if params > LAYER_MAX_PARAMS:
        raise NotApplicable(
            f"one tp={tp} layer has {params / 1e6:.0f}e6 parameters, more than "
            f"LAYER_MAX_PARAMS={LAYER_MAX_PARAMS / 1e6:g}e6 (kb_nano.operators.layers)"
        )
    counts = _param_counts(cfg)
    if not counts["rotary"]:  # (OPT, Zamba2, NoPE Granite-4.0-H: no decoder-level rotary module)
        raise NotApplicable(
            "not covered: the decoder has no rotary_emb module; kb-nano's decoder_layer gives the layer "
            "its rotary cos/sin"
        )
    if not counts["layer0_attention"]:  # (Jamba's Mamba, Lfm2's conv, Qwen3-Next's linear attention)
        raise NotApplicable(
            f"not covered: layer 0 is not a self-attention layer (it has {', '.join(counts['layer0_children'])})"
        )
    return {"config": config, "layer_idx": 0, "tp_size": tp}


def _layer_inputs(args, facts, tp, num_tokens, dtype):
    config = args["config"]
    _check_sliding_window(config, num_tokens)
    return [
        normal("hidden_states", [num_tokens, _field(config, facts, "hidden_size")], dtype),
        randint("positions", [num_tokens], 0, _positions(config, facts)),
    ]


def _positions(config: dict, facts: dict) -> int:
    """The positions a scenario draws below: the model's ``max_position_embeddings`` (the
    facts read it through the config object: GPT-2's ``n_positions``), else the config.json
    field. Raises ``NotApplicable`` for a model without one (ALiBi)."""
    limit = _field(config, facts, "max_position_embeddings")
    if not limit:
        raise NotApplicable("not covered: the config has no max_position_embeddings to draw positions below")
    return limit


def _field(config: dict, facts: dict, name: str) -> int | None:
    """The model's ``name`` from its facts, else from its config.json fields ``config``
    under that name or its ``attribute_map`` alias (:func:`config_field`: GPT-2's ``n_embd``)."""
    value = facts.get(name) or config_field({"hf_config": config}, name)
    return None if value is None else int(value)


def _model_init_args(facts: dict, tp: int) -> dict:
    if tp != 1:
        raise NotApplicable(
            "model is measured at tp=1 only: a whole model at tp>1 interleaves per-rank compute with "
            "all-reduces and a logits gather (decoder_layer measures one rank's layer)"
        )
    config = model_config(facts)
    cfg = hf_config(config, 1, num_hidden_layers=MODEL_NUM_LAYERS)
    params = _param_counts(cfg)["total"]
    if params > MODEL_MAX_PARAMS:
        raise NotApplicable(
            f"the {MODEL_NUM_LAYERS}-layer model has {params / 1e9:.2f}e9 parameters (real vocabulary), more "
            f"than MODEL_MAX_PARAMS={MODEL_MAX_PARAMS / 1e9:g}e9 (kb_nano.operators.layers)"
        )
    return {"config": config, "num_hidden_layers": MODEL_NUM_LAYERS}


def _model_inputs(args, facts, tp, num_tokens, dtype):
    config = args["config"]
    _check_sliding_window(config, num_tokens)
    return [
        randint("input_ids", [num_tokens], 0, _field(config, facts, "vocab_size")),
        randint("positions", [num_tokens], 0, _positions(config, facts)),
    ]


def _param_counts(cfg) -> dict:
    """:func:`_count_params`, memoised per config (the manifest asks once per scenario)."""
    key = cfg.to_json_string(use_diff=False)
    if key not in _PARAM_COUNTS:
        _PARAM_COUNTS[key] = _count_params(cfg)
    return _PARAM_COUNTS[key]


_PARAM_COUNTS: dict = {}


def _count_params(cfg) -> dict:
    """Parameter counts of the transformers model of ``cfg`` built on the meta device:
    ``layer`` (one decoder layer), ``expert_fraction`` (share of a layer's parameters in
    routed experts), ``top_k``/``num_experts``, ``embedding``, ``lm_head`` (0 when tied),
    ``total``, and what the ``decoder_layer`` baseline needs: ``rotary`` (the decoder has a
    ``rotary_emb`` module), ``layer0_attention`` (layer 0 has a ``self_attn``,
    ``attention`` or ``self_attention`` child) and ``layer0_children`` (its child names)."""
    lm = _meta_causal_lm(cfg)
    # the decoder's layers (get_decoder() is the whole model for some classes: Llama-4)
    layers = next(
        (m for n, m in lm.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList)), None
    )
    if not layers:  # (Falcon's are transformer.h)
        raise NotApplicable(f"not covered: {type(lm).__name__} has no `layers` list of decoder layers")
    layer = layers[0]
    layer_params = sum(p.numel() for p in layer.parameters())
    expert_params = sum(p.numel() for n, p in layer.named_parameters() if ".experts." in f".{n}")
    embedding = lm.get_input_embeddings().weight.numel()
    head = lm.get_output_embeddings()
    tied = head is not None and head.weight is lm.get_input_embeddings().weight
    lm_head = 0 if head is None or tied else head.weight.numel()
    num_experts = int(getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0)
    return {
        "layer": layer_params,
        "expert_fraction": expert_params / layer_params if layer_params else 0.0,
        "num_experts": num_experts,
        "top_k": int(getattr(cfg, "num_experts_per_tok", 0) or 0),
        "embedding": embedding,
        "lm_head": lm_head,
        "head_out": head.weight.shape[0] if head is not None else 0,
        "total": sum(p.numel() for p in lm.parameters()),  # tied parameters counted once
        "rotary": getattr(lm.get_decoder(), "rotary_emb", None) is not None,
        "layer0_attention": any(hasattr(layer, n) for n in ("self_attn", "attention", "self_attention")),
        "layer0_children": list(dict(layer.named_children())),
    }


def _layer_cost(counts: dict, cfg, n: int, es: int) -> tuple[int, int]:
    """Minimum weight bytes read and FLOPs of one decoder layer on n tokens (causal prefill)."""
    layer = counts["layer"]
    experts = layer * counts["expert_fraction"]
    dense = layer - experts
    if counts["num_experts"]:
        touched = min(counts["num_experts"], n * counts["top_k"]) / counts["num_experts"]
        active = counts["top_k"] / counts["num_experts"]
    else:
        touched = active = 0.0
    weight_bytes = int((dense + experts * touched) * es)
    heads, d = int(cfg.num_attention_heads), int(cfg.head_dim)
    attention = 4 * heads * d * n * (n + 1) // 2  # QK^T and PV over the causal triangle
    flops = int(2 * n * (dense + experts * active)) + attention
    return weight_bytes, flops


def _layer_traffic(args, inputs, dtype):
    cfg = hf_config(args["config"], args["tp_size"], num_hidden_layers=1)
    n = inputs[0]["shape"][0]
    es = element_size(inputs[0]["dtype"])
    weight_bytes, flops = _layer_cost(_param_counts(cfg), cfg, n, es)
    return weight_bytes + 2 * n * cfg.hidden_size * es + n * 8, flops


def _model_traffic(args, inputs, dtype):
    cfg = hf_config(args["config"], 1, num_hidden_layers=args["num_hidden_layers"])
    n = inputs[0]["shape"][0]
    es = element_size(dtype)
    counts = _param_counts(cfg)
    layer_bytes, layer_flops = _layer_cost(counts, cfg, n, es)
    h = cfg.hidden_size
    head = counts["head_out"] * h  # the LM head reads its whole weight (tied or not)
    nbytes = args["num_hidden_layers"] * layer_bytes + n * h * es + head * es + n * counts["head_out"] * es + 2 * n * 8
    flops = args["num_hidden_layers"] * layer_flops + 2 * n * head
    return int(nbytes), int(flops)


OPERATORS = {
    "decoder_layer": Operator(
        name="decoder_layer",
        level=3,
        category="layer",
        baseline=DecoderLayer,
        init_args=_layer_init_args,
        inputs=_layer_inputs,
        traffic=_layer_traffic,
        used_in="model.layers.* (input_layernorm, self_attn with rotary, post_attention_layernorm, mlp)",
        tolerance=dict(LAYER_TOLERANCE),
    ),
    "model": Operator(
        name="model",
        level=4,
        category="model",
        baseline=CausalLM,
        init_args=_model_init_args,
        inputs=_model_inputs,
        traffic=_model_traffic,
        used_in=f"the whole causal LM with its first {MODEL_NUM_LAYERS} layers (embed_tokens, layers, norm, lm_head)",
        tolerance=dict(LAYER_TOLERANCE),
    ),
}
