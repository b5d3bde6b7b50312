"""The attention half of the module tree: the kinds of self-attention layer a model's own
attention modules compute (softmax scale, sliding window, attention chunks, soft-cap, sinks,
multi-head latent attention), or why they are not covered; read on the meta-built model by
:func:`kb_nano.models.module_tree.read`."""

from __future__ import annotations

import re

import torch

PROBE_ROWS = 4  # random rows each probe of a module's computation runs on (norms, sinks)

# The parts of a transformers attention module around what kb-nano's ``attention``
# measures (projections outside it; q/k norms are the ``qk_norm`` operator's: Qwen3's
# ``q_norm``/``k_norm``, Llama-4's one weightless ``qk_norm``): a module with any other
# child module or a parameter of its own is ``not covered`` (multi-head latent attention,
# which has ``kv_a_proj_with_mqa``, is read by :func:`kb_nano.operators.mla.mla_layer`); a
# ``sinks`` parameter is covered when :func:`sinks_reason` finds the module's attention
# computes gpt-oss's sinks
# (GPT-NeoX and Falcon fuse the projections as ``query_key_value`` and call the output one
# ``dense``); a dropout child is the identity at inference
ATTENTION_CHILDREN = {
    *("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "dense", "out_proj"),
    *("q_norm", "k_norm", "qk_norm", "rotary_emb"),
}
# (OPT, GPT-J and Lfm2 call the output projection ``out_proj``; the per-head q/k norm pairs
# of :func:`qk_norm_names` count as q/k norms whatever they are called)

# A q/k norm child of an attention module: ``q`` or ``query``, ``_``, then a norm's name
# (Qwen3's ``q_norm``, Lfm2's and Persimmon's ``q_layernorm``, HunYuan's
# ``query_layernorm``); its k partner has the same suffix after ``k`` / ``key``
_Q_NORM_NAME = re.compile(r"^(q|query)_(\w*norm\w*|ln)$")
_K_PREFIX = {"q": "k", "query": "key"}


def qk_norm_names(module: torch.nn.Module) -> tuple[str, str] | None:
    """The names of the attention module's per-head q and k norm children (``q_norm`` /
    ``k_norm``, ``q_layernorm`` / ``k_layernorm``, ``query_layernorm`` / ``key_layernorm``:
    a ``q``/``query`` child named as :data:`_Q_NORM_NAME` whose ``k``/``key`` partner of the
    same suffix is a module too), or None."""
    children = dict(module.named_children())
    for name in children:
        match = _Q_NORM_NAME.match(name)
        if match:
            partner = f"{_K_PREFIX[match[1]]}_{match[2]}"
            if isinstance(children.get(partner), torch.nn.Module):
                return name, partner
    return None


# The names transformers gives the list of decoder layers: ``layers`` (Llama and most),
# ``h`` (GPT-2-style trees: GPT-2, GPT-J, Bloom, Falcon), ``blocks`` (MPT, DBRX)
LAYER_LISTS = r"(layers|h|blocks)"
# The names transformers gives a decoder layer's self-attention module: ``self_attn``
# (Llama and most), ``attention`` (GPT-NeoX), ``self_attention`` (Falcon, Bloom), ``attn``
# (GPT-2, GPT-J, MPT)
_ATTENTION_NAME = re.compile(rf"(^|\.){LAYER_LISTS}\.\d+\.(self_attn|attention|self_attention|attn)$")


# The layer types (transformers' ``config.layer_types``) whose attention kb-nano computes:
# causal over every earlier key, over the last ``sliding_window`` of them, or over the
# earlier keys of the query's chunk of ``attention_chunk_size`` tokens (Llama-4)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def _unlike_attention(module: torch.nn.Module) -> str | None:
    """What an attention module with the standard parts computes beyond kb-nano's
    ``attention`` (a clause for a ``not covered`` reason), else None: its layer type in
    the config's ``layer_types`` (by its ``layer_idx``) other than those of
    :data:`ATTENTION_LAYER_TYPES` (sparse and compressed kinds), or chunked attention
    without a positive ``attention_chunk_size``. Llama-4's ``attn_temperature_tuning``
    (queries scaled by position on its layers without rotation) is not a reason: vLLM's
    ``Llama4Attention.forward`` scales q in torch before calling its ``Attention``, as
    it applies RoPE, so the op's inputs are the scaled queries."""
    if _layer_type(module) == "chunked_attention" and not _chunk_size(module):
        return f"layer {module.layer_idx} is chunked attention without a positive attention_chunk_size"
    kind = _layer_type(module)
    if kind is not None and kind not in ATTENTION_LAYER_TYPES:
        return f"layer {module.layer_idx} is {kind!r} (kb-nano's attention computes {', '.join(ATTENTION_LAYER_TYPES)})"
    return None


def _layer_type(module: torch.nn.Module) -> str | None:
    """The attention module's entry of its config's ``layer_types`` (by ``layer_idx``), or
    None where the config has none."""
    config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if isinstance(types, list | tuple) and isinstance(idx, int) and idx < len(types):
        return str(types[idx])
    return None


def first_decoder_layer(lm: torch.nn.Module) -> torch.nn.Module | None:
    """The first decoder layer of the causal LM ``lm``: the module named ``...layers.0``
    (``...h.0`` in GPT-2-style trees, Falcon's; ``...blocks.0``: MPT), or None."""
    return next((m for n, m in lm.named_modules() if re.search(rf"(^|\.){LAYER_LISTS}\.0$", n)), None)


def attention_modules(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention module of each decoder layer of the causal LM ``lm``, in layer
    order: the child named ``self_attn``, ``attention``, ``self_attention`` or ``attn`` of
    a module named ``...layers.<i>``, ``...h.<i>`` or ``...blocks.<i>`` (:data:`LAYER_LISTS`)."""
    return [m for n, m in lm.named_modules() if _ATTENTION_NAME.search(n)]


def kv_heads(lm: torch.nn.Module) -> int | None:
    """The KV heads the first attention module of ``lm`` computes with, from its own
    ``num_key_value_heads`` or ``num_kv_heads`` attribute (Falcon keeps its count there,
    1 for multi-query, not in a ``num_key_value_heads`` config field), else None (the
    module reads its config's, as Llama's does)."""
    for module in attention_modules(lm)[:1]:
        for attr in ("num_key_value_heads", "num_kv_heads"):
            value = getattr(module, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _unlike_heads(module: torch.nn.Module, kv_seen: set[int]) -> str | None:
    """What the module's heads do beyond kb-nano's ``attention`` (one head size for q, k
    and v; one KV head count for every layer), else None: a ``v_head_dim`` other than its
    ``head_dim`` (MiMo-V2-Flash: values 128 wide, keys 192), or KV heads (``k_proj``'s
    width over ``head_dim``) unlike an earlier layer's (``kv_seen``, updated here)."""
    head_dim = getattr(module, "head_dim", None)
    v_dim = getattr(module, "v_head_dim", None)
    if isinstance(head_dim, int) and isinstance(v_dim, int) and v_dim != head_dim:
        return f"has values of {v_dim} per head and queries/keys of {head_dim}"
    k_proj = getattr(module, "k_proj", None)
    if isinstance(head_dim, int) and head_dim > 0 and isinstance(k_proj, torch.nn.Linear):
        kv_seen.add(k_proj.out_features // head_dim)
        if len(kv_seen) > 1:
            return f"layers differ in KV heads ({', '.join(map(str, sorted(kv_seen)))})"
    return None


def _alibi(module: torch.nn.Module) -> bool:
    """Whether the attention module adds a position bias to its logits: its config's
    ``alibi`` (Falcon, which passes ``alibi=None`` when it is off), else a ``forward`` that
    takes an ``alibi`` or ``position_bias`` argument (Bloom, MPT: always)."""
    import inspect

    flag = getattr(getattr(module, "config", None), "alibi", None)
    if flag is not None:
        return bool(flag)
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return "alibi" in params or "position_bias" in params


def _scale(module: torch.nn.Module) -> float | None:
    """The softmax scale of the attention module: its ``scaling`` (transformers' common
    attribute) or Falcon's ``inv_norm_factor`` (``1 / sqrt(head_dim)``, the scale of
    its ``scaled_dot_product_attention``), else None."""
    for attr in ("scaling", "inv_norm_factor"):
        value = getattr(module, attr, None)
        if isinstance(value, int | float):
            return float(value)
    return None


def _sliding_window(module: torch.nn.Module) -> int | None:
    """The sliding window the attention module's forward passes, or None (causal over
    every earlier key). A module without a ``sliding_window`` attribute passes its
    config's on every layer (transformers' Mistral, Mixtral, Phi-3, Starcoder2, OLMoE:
    ``sliding_window=getattr(self.config, "sliding_window", None)``); one with it passes
    the attribute, on a ``sliding_attention`` layer only where the config has
    ``layer_types`` (Exaone-4 sets it on every layer and passes it on its sliding ones;
    Qwen2, Gemma-2/3 and gpt-oss set it to None on their full ones). A window of at least
    the config's ``max_position_embeddings`` hides no key (Phi-3.5-MoE's mask has 131072
    = its ``max_position_embeddings``): None."""
    config = getattr(module, "config", None)
    if not hasattr(module, "sliding_window"):
        window = getattr(config, "sliding_window", None)
    elif _layer_type(module) not in (None, "sliding_attention"):
        window = None
    else:
        window = module.sliding_window
    if not isinstance(window, int) or window <= 0:
        return None
    limit = getattr(config, "max_position_embeddings", None)
    return None if isinstance(limit, int) and window >= limit else int(window)


def _chunk_size(module: torch.nn.Module) -> int | None:
    """The attention chunk of a ``chunked_attention`` layer: its config's
    ``attention_chunk_size`` (Llama-4: 8192), else None."""
    size = getattr(getattr(module, "config", None), "attention_chunk_size", None)
    return int(size) if isinstance(size, int) and size > 0 else None


def attention_layers(lm: torch.nn.Module) -> dict:
    """The kinds of self-attention layer of the causal LM ``lm`` (built on the meta device
    with every layer, :func:`read`), read from each decoder layer's attention module
    (:func:`attention_modules`):
    ``{"kinds": [{"scale", "sliding_window", "attention_chunk_size", "logits_soft_cap",
    "sinks", "layers"}, ...], "reason": None}`` with one entry per distinct (softmax scale,
    sliding window, attention chunk, soft-cap, sinks) in layer order (``layers``: how many
    layers have it; the module's scale (:func:`_scale`), :func:`_sliding_window`, the config's
    ``attention_chunk_size`` on a ``chunked_attention`` layer, ``attn_logit_softcapping``
    and whether it has a ``sinks`` parameter; multi-head latent attention adds ``"mla"``, its dimensions
    from :func:`kb_nano.operators.mla.mla_layer`), or ``{"kinds": [], "reason": "not
    covered: ..."}`` for an attention module with parts kb-nano does not measure
    (:data:`ATTENTION_CHILDREN`; sinks that :func:`sinks_reason` rejects; an MLA class
    ``mla_layer`` rejects)."""
    from kb_nano.operators.mla import mla_layer

    kinds: dict[tuple, dict] = {}
    probed: dict[type, str | None] = {}  # attention class -> sinks_reason
    kv_seen: set[int] = set()  # KV heads of the layers so far (_unlike_heads)
    for module in attention_modules(lm):
        cls = type(module).__name__
        mla = mla_layer(module) if hasattr(module, "kv_a_proj_with_mqa") else None
        if isinstance(mla, str):
            return {"kinds": [], "reason": mla}
        if _alibi(module):
            return {"kinds": [], "reason": f"not covered: {cls} adds an ALiBi position bias to the logits"}
        known = ATTENTION_CHILDREN | set(qk_norm_names(module) or ())
        extra = sorted(
            n for n, child in module.named_children() if n not in known and not isinstance(child, torch.nn.Dropout)
        )
        own = sorted(n for n, _ in module.named_parameters(recurse=False) if n != "sinks")
        if (extra or own) and mla is None:
            parts = [f"{n} ({type(getattr(module, n)).__name__})" for n in extra] + own
            return {"kinds": [], "reason": f"not covered: {cls} has {', '.join(parts)}"}
        unlike = _unlike_attention(module) or (None if mla else _unlike_heads(module, kv_seen))
        if unlike:
            return {"kinds": [], "reason": f"not covered: {cls} {unlike}"}
        sinks = isinstance(getattr(module, "sinks", None), torch.nn.Parameter)
        if sinks:
            if type(module) not in probed:
                probed[type(module)] = sinks_reason(module)
            if probed[type(module)]:
                return {"kinds": [], "reason": probed[type(module)]}
        window = _sliding_window(module)
        chunk = _chunk_size(module) if _layer_type(module) == "chunked_attention" else None
        cap = getattr(module, "attn_logit_softcapping", None)
        scale = _scale(module)
        if scale is None:
            return {"kinds": [], "reason": f"not covered: {cls} has no softmax scale kb-nano can read (scaling)"}
        key = (scale, window, chunk, float(cap) if cap else None, sinks)
        key += (tuple(mla.values()),) if mla else ()
        entry = kinds.setdefault(
            key,
            {"scale": key[0], "sliding_window": key[1]}
            | ({"attention_chunk_size": chunk} if chunk else {})
            | {"logits_soft_cap": key[3], "sinks": sinks}
            | ({"mla": mla} if mla else {})
            | {"layers": 0},
        )
        entry["layers"] += 1
    if not kinds:
        layer = first_decoder_layer(lm)
        has = f" ({type(layer).__name__} has {', '.join(dict(layer.named_children()))})" if layer is not None else ""
        return {
            "kinds": [],
            "reason": f"not covered: no decoder layer has a self_attn, attention, self_attention or attn module{has}",
        }
    return {"kinds": list(kinds.values()), "reason": None}


def sinks_reason(meta_module: torch.nn.Module) -> str | None:
    """None when the ``sinks`` parameter of the attention module ``meta_module`` (meta
    device) is a sink logit per query head that the ``attention`` baseline computes
    (``Attention(..., sinks=True)``), else the ``not covered: ...`` reason. Probed: the
    ``eager_attention_forward`` of the module's own modeling file is run on the CPU on
    :data:`PROBE_ROWS` random float32 tokens of causal attention with random sinks (the
    module's query and KV head counts, head size and scale) and compared with the baseline (relative tolerance 1e-4)."""
    import sys
    from types import SimpleNamespace

    from kb_nano.operators.attention import Attention

    cls = type(meta_module).__name__
    sinks = meta_module.sinks
    eager = getattr(sys.modules.get(type(meta_module).__module__), "eager_attention_forward", None)
    groups = getattr(meta_module, "num_key_value_groups", None)
    head_dim = getattr(meta_module, "head_dim", None)
    if sinks.dim() != 1 or eager is None or not groups or not head_dim:
        return f"not covered: {cls} has sinks of shape {list(sinks.shape)} kb-nano cannot probe"
    heads, n, scale = int(sinks.shape[0]), PROBE_ROWS, float(meta_module.scaling)
    kv = heads // int(groups)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, w * head_dim, generator=gen) for w in (heads, kv, kv))
    ours = Attention(heads, head_dim, scale, kv, sinks=True)
    with torch.no_grad():
        ours.sinks.copy_(torch.randn(heads, generator=gen) * 2)
        pos = torch.arange(n)
        mask = torch.zeros(n, n).masked_fill(pos[None, :] > pos[:, None], torch.finfo(torch.float32).min)
        stub = SimpleNamespace(sinks=ours.sinks.clone(), num_key_value_groups=int(groups), training=False)
        try:
            ref, _ = eager(
                stub, *(t.view(1, n, -1, head_dim).transpose(1, 2) for t in (q, k, v)), mask, scaling=scale, dropout=0.0
            )
        except Exception as exc:
            return f"not covered: {cls} has sinks; its eager attention failed on a probe ({type(exc).__name__})"
        if not torch.allclose(ours(q, k, v), ref.reshape(n, heads * head_dim), rtol=1e-4, atol=1e-5):
            return f"not covered: {cls} has sinks that compute other than the extra softmax column of gpt-oss"
    return None
