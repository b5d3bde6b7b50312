"""How a model's attention layers become ``attention`` scenarios: the layer kinds read from
its module tree, the baseline's constructor arguments per kind and TP rank, the semantics
a candidate declares, the decode context lengths, the inputs and their value ranges, and
the traffic (see :mod:`kb_nano.operators.attention` for the semantics themselves)."""

from __future__ import annotations

from kb_nano.operators import mla
from kb_nano.operators.base import (
    NotApplicable,
    config_field,
    element_size,
    kv_heads_per_rank,
    normal,
    shard,
)

# Decode context lengths when the manifest is not given ``context_lens`` (config key of the
# same name). Small so the default sweep stays cheap on a CPU, where eager decode attention
# of 64 sequences x 1024 cached tokens takes ~1 s per call in bf16.
DEFAULT_CONTEXT_LENS = (256,)
# Decode scenarios hold at most this many cached tokens (num_tokens x context_len) in one
# layer's cache: about the whole KV cache of a real deployment (Llama-3.1-8B keeps 128 KiB
# per token over its 32 layers, so an 80 GB GPU holds ~0.6M tokens). Beyond it the eager
# baseline's repeated-KV copy alone needs tens of GB (1024 x 8192 tokens: 64 GiB).
MAX_DECODE_CACHE_TOKENS = 2**20


def attention_scale(facts: dict) -> float:
    """Softmax scale of the model: ``query_pre_attn_scalar ** -0.5`` where the config has
    it (Gemma-2), else ``head_dim ** -0.5`` (transformers ``self.scaling``)."""
    scalar = config_field(facts, "query_pre_attn_scalar")
    return float(scalar) ** -0.5 if scalar else float(facts["head_dim"]) ** -0.5


def layer_kinds(facts: dict) -> list[tuple[str, dict]]:
    """One kind per distinct attention layer of the model (``facts['attention_layers']``):
    ``""`` when all layers are alike, else ``sliding<W>`` / ``chunked<C>`` / ``full`` (numbered when two
    kinds would share a name); the overrides carry the kind (``attention_kind``) or the
    ``not covered`` reason (``attention_not_covered``). Facts without the module tree
    (unit tests) give one kind from the config's fields."""
    layers = facts.get("attention_layers")
    if layers is None:
        return [("", {})]
    if layers["reason"]:
        return [("", {"attention_not_covered": layers["reason"]})]
    kinds = layers["kinds"]
    if len(kinds) == 1:
        return [("", {"attention_kind": kinds[0]})]
    names = [
        f"sliding{k['sliding_window']}"
        if k["sliding_window"]
        else f"chunked{k['attention_chunk_size']}"
        if k.get("attention_chunk_size")
        else "full"
        for k in kinds
    ]
    names = [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    return [(n, {"attention_kind": k}) for n, k in zip(names, kinds, strict=True)]


def init_args(facts: dict, tp: int) -> dict:
    if facts.get("attention_not_covered"):
        raise NotApplicable(facts["attention_not_covered"])
    kind = facts.get("attention_kind")
    if kind is None:  # facts without the module tree: the config's fields
        cap = config_field(facts, "attn_logit_softcapping")
        kind = {"scale": attention_scale(facts), "sliding_window": None, "logits_soft_cap": float(cap) if cap else None}
    if kind.get("mla"):
        return mla.mla_init_args(kind, facts["num_attention_heads"], tp)
    return {
        "num_heads": shard(facts["num_attention_heads"], tp, "num_attention_heads"),
        "head_size": facts["head_dim"],
        "scale": kind["scale"],
        "num_kv_heads": kv_heads_per_rank(facts["num_key_value_heads"], tp),
        "logits_soft_cap": kind["logits_soft_cap"],
        **({"per_layer_sliding_window": kind["sliding_window"]} if kind["sliding_window"] else {}),
        **({"attention_chunk_size": kind["attention_chunk_size"]} if kind.get("attention_chunk_size") else {}),
        **({"sinks": True} if kind.get("sinks") else {}),
    }


def semantics(facts: dict) -> str:
    """The layer kind's non-standard parts, joined by ``+``: ``sliding_window``, ``sinks``,
    ``sliding_window+sinks`` (gpt-oss's sliding layers), ``chunked_attention`` (Llama-4's
    layers with rotation), ``mla`` (DeepSeek-V3) or ``""``."""
    kind = facts.get("attention_kind") or {}
    parts = {
        "sliding_window": "sliding_window",
        "sinks": "sinks",
        "attention_chunk_size": "chunked_attention",
        "mla": "mla",
    }
    return "+".join(name for key, name in parts.items() if kind.get(key))


def variants(facts: dict, options: dict) -> list[tuple[str, dict]]:
    """Prefill, then decode at each ``context_lens`` (default :data:`DEFAULT_CONTEXT_LENS`),
    plus decode contexts that make the model's local layers hide keys (each at most the
    model's ``max_position_embeddings`` - 1): one long enough, unless a context is that
    long already: 2 W for a sliding window W, where the window hides about half the keys
    (at W + 16 it hid 16 of 4112 and a kernel without the window stayed within the
    tolerance), or C + C / 2 for attention chunks of C tokens (Llama-4), where the query's
    chunk holds the last C / 2 + 1 keys; and for chunks always C itself, where the query
    is the first of a new chunk and sees only itself, so a kernel whose chunk starts one
    key early or late fails by a whole output (at C + C / 2 one key of 4097 moved the
    output within the tolerance on some inputs). A prefill crosses a chunk (or a window)
    only at ``num_tokens`` beyond it (``--num-tokens 8200`` for Llama-4)."""
    lens = options.get("context_lens")
    lens = list(DEFAULT_CONTEXT_LENS if lens is None else lens)
    kinds = (facts.get("attention_layers") or {}).get("kinds", [])
    limit = int(facts.get("max_position_embeddings") or 2**62) - 1  # (ALiBi models: no position limit)
    chunks = sorted({c for k in kinds if (c := k.get("attention_chunk_size"))})
    needed = [2 * k["sliding_window"] for k in kinds if k["sliding_window"]] + [c + c // 2 for c in chunks]
    if needed and lens:
        longest = min(max(needed), limit)
        added = [c for c in chunks if c <= limit and c not in lens]
        lens += added + ([longest] if max(lens) < longest and longest not in added else [])
    return [("", {})] + [(f"ctx{int(c)}", {"context_len": int(c)}) for c in lens]


def inputs(args, facts, tp, num_tokens, dtype, context_len: int | None = None):
    check_lengths(facts, num_tokens, context_len)
    if args.get("kv_lora_rank"):
        return mla.mla_inputs(args, num_tokens, dtype, context_len)
    h, kv, d = args["num_heads"], args["num_kv_heads"], args["head_size"]
    cap = args.get("logits_soft_cap")
    # logits q.k * scale have std s^2 * sqrt(d) * scale on N(0, s^2) inputs: the cap's size;
    # with sinks 1, the logit spread :data:`SINK_MAX` is calibrated for
    if cap:
        std = (cap / (d**0.5 * args["scale"])) ** 0.5
    elif args.get("sinks"):
        std = (d**0.5 * args["scale"]) ** -0.5
    else:
        std = 1.0
    specs = [
        normal("query", [num_tokens, h * d], dtype, std),
        normal("key", [num_tokens, kv * d], dtype, std),
        normal("value", [num_tokens, kv * d], dtype),
    ]
    if context_len is None:
        return specs
    return specs + [
        normal("key_cache", [num_tokens, context_len, kv, d], dtype, std),
        normal("value_cache", [num_tokens, context_len, kv, d], dtype),
    ]


def check_lengths(facts: dict, num_tokens: int, context_len: int | None) -> None:
    """Raises ``NotApplicable`` for a prefill longer than the model's
    ``max_position_embeddings``, a decode position beyond it, or a decode cache of more
    than :data:`MAX_DECODE_CACHE_TOKENS` tokens. A model without ``max_position_embeddings``
    (ALiBi: Bloom, MPT) has no position limit."""
    limit = facts.get("max_position_embeddings") or float("inf")
    if context_len is None:
        if num_tokens > limit:
            raise NotApplicable(
                f"num_tokens={num_tokens} exceeds max_position_embeddings={facts['max_position_embeddings']}"
            )
        return
    if context_len + 1 > limit:
        raise NotApplicable(
            f"context_len={context_len} + 1 exceeds max_position_embeddings={facts['max_position_embeddings']}"
        )
    if num_tokens * context_len > MAX_DECODE_CACHE_TOKENS:
        raise NotApplicable(
            f"{num_tokens} sequences x {context_len} cached tokens exceed MAX_DECODE_CACHE_TOKENS="
            f"{MAX_DECODE_CACHE_TOKENS} (kb_nano.operators.attention_scenarios)"
        )


def traffic(args, inputs, dtype):
    if args.get("kv_lora_rank"):
        return mla.mla_traffic(args, inputs)
    h, kv, d = args["num_heads"], args["num_kv_heads"], args["head_size"]
    n = inputs[0]["shape"][0]
    es = element_size(inputs[0]["dtype"])
    qkvo = n * (2 * h + 2 * kv) * d * es + (h * es if args.get("sinks") else 0)
    if len(inputs) == 3:  # prefill, causal
        return qkvo, 4 * h * d * (n * (n + 1) // 2)
    ctx = inputs[3]["shape"][1]
    return qkvo + 2 * n * ctx * kv * d * es, 4 * h * d * n * (ctx + 1)
