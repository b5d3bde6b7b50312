"""What the kernel swapper (:mod:`kb_nano.e2e.swap`) matches and how it builds a candidate there:
the table from module classes (transformers' and kb-nano's) to targets, the rules that
derive a candidate's constructor arguments and state-dict keys from the module it replaces,
and the adapters for modules called with another convention (see :mod:`kb_nano.e2e.swap`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kb_nano import operators
from kb_nano.errors import KbNanoError


class SwapError(KbNanoError):
    """A candidate could not replace a module (arguments, weights, conflicting candidates)."""


# --------------------------------------------------------------------------- args rules


def _norm_args(m: nn.Module) -> dict:
    return {"hidden_size": int(m.weight.shape[0]), "eps": float(m.variance_epsilon)}


def _no_args(m: nn.Module) -> dict:
    return {}


def _rotary_args(m: nn.Module) -> dict:
    return {
        "head_size": m.head_size,
        "rotary_dim": m.rotary_dim,
        "max_position_embeddings": m.max_position_embeddings,
        "base": m.base,
        "is_neox_style": m.is_neox_style,
        "dtype": str(m.cos_sin_cache.dtype).removeprefix("torch."),
        "rope_scaling": dict(m.rope_scaling) or None,
    }


def _embedding_args(m: nn.Module) -> dict:
    from kb_nano.operators.embedding import pad_vocab_size

    rows = m.num_embeddings_per_partition
    if m.vocab_start_index != 0 or pad_vocab_size(m.vocab_end_index) != rows:
        # A rank of a TP>1 embedding does not record the global vocabulary size.
        raise SwapError("only a tp_size=1 VocabParallelEmbedding can be rebuilt from its attributes")
    return {"num_embeddings": m.vocab_end_index, "embedding_dim": int(m.weight.shape[1]), "tp_size": 1, "tp_rank": 0}


def _recorded_args(m: nn.Module) -> dict:
    """kb-nano L3/L4 baselines record their constructor arguments."""
    return dict(m.init_args)


def _hf_layer_args(m: nn.Module) -> dict:
    """A transformers decoder layer: its config (as config.json fields) and layer index."""
    attn = m.self_attn
    return {"config": attn.config.to_dict(), "layer_idx": int(attn.layer_idx), "tp_size": 1}


def _hf_mlp_args(m: nn.Module) -> dict:
    """A transformers gated MLP -> kb-nano ``mlp`` (vLLM ``LlamaMLP`` signature)."""
    return {
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "hidden_act": m.config.hidden_act,
        "bias": m.gate_proj.bias is not None,
    }


def _hf_mlp_state(state: dict) -> dict:
    """transformers ``gate_proj``/``up_proj`` -> vLLM's merged ``gate_up_proj`` (gate rows first)."""
    out = {}
    for kind in ("weight", "bias"):
        if f"gate_proj.{kind}" in state:
            out[f"gate_up_proj.{kind}"] = torch.cat((state[f"gate_proj.{kind}"], state[f"up_proj.{kind}"]))
            out[f"down_proj.{kind}"] = state[f"down_proj.{kind}"]
    return out


def _hf_mlp_unstate(state: dict) -> dict:
    """Inverse of :func:`_hf_mlp_state`."""
    out = {}
    for kind in ("weight", "bias"):
        if f"gate_up_proj.{kind}" in state:
            gate, up = state[f"gate_up_proj.{kind}"].chunk(2)
            out.update(
                {f"gate_proj.{kind}": gate, f"up_proj.{kind}": up, f"down_proj.{kind}": state[f"down_proj.{kind}"]}
            )
    return out


def _mlp_args(m: nn.Module) -> dict:
    """kb-nano's ``mlp`` baseline (``LlamaMLP`` of one TP rank)."""
    return {
        "hidden_size": m.gate_up_proj.in_features,
        "intermediate_size": m.down_proj.in_features * m.tp_size,
        "hidden_act": m.hidden_act,
        "bias": m.gate_up_proj.bias is not None,
        "tp_size": m.tp_size,
    }


# --------------------------------------------------------------------------- adapters


def _tokens_adapter(module: nn.Module) -> None:
    """Call the candidate on ``[num_tokens, ...]``: flatten leading dims, restore them after."""
    inner = module.forward

    def forward(x, *args, **kwargs):
        lead = x.shape[:-1]
        out = inner(x.reshape(-1, x.shape[-1]), *args, **kwargs)
        return out.reshape(*lead, out.shape[-1])

    module.forward = forward


def _is_plain_causal(mask, seq_len: int) -> bool:
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2:] != (seq_len, seq_len):
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=mask.device).tril()
    return bool((allowed == causal).all())


def _hf_decoder_layer_adapter(module: nn.Module) -> None:
    """Let a kb-nano ``decoder_layer`` candidate stand in for a transformers decoder layer:
    transformers calls ``layer(hidden_states [B, S, H], attention_mask=..., position_ids=...,
    position_embeddings=..., cache=...)``; each sequence b goes through
    ``candidate(hidden_states[b], position_ids[b])`` (the candidate computes its own rotary
    tables). Only a plain causal mask (no padding) and no KV cache are supported."""
    inner = module.forward

    def forward(
        hidden_states,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=False,
        position_embeddings=None,
        past_key_values=None,
        **kwargs,
    ):
        batch, seq_len = hidden_states.shape[:2]
        if cache is not None or past_key_values is not None:
            raise NotImplementedError(
                f"{type(module).__name__} (swapped in by kb_nano.e2e.swap) does not support a KV cache"
            )
        if not _is_plain_causal(attention_mask, seq_len):
            raise NotImplementedError(
                f"{type(module).__name__} (swapped in by kb_nano.e2e.swap) supports only a causal mask without padding"
            )
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=hidden_states.device)[None]
        position_ids = position_ids.expand(batch, seq_len)
        return torch.stack([inner(hidden_states[b], position_ids[b]) for b in range(batch)])

    module.forward = forward


# --------------------------------------------------------------------------- table


@dataclass(frozen=True)
class Match:
    """One row of the matching table: modules of class ``cls`` ("module:Class") are covered by
    ``target``; ``args`` derives the candidate's constructor arguments from the module;
    ``state`` (optional) maps the module's state dict to the target's keys (transformers'
    separate gate/up projections -> vLLM's merged ``gate_up_proj``) and ``unstate`` back (used
    when a higher-level candidate takes over the weights); ``adapter`` (optional) fits the
    candidate's forward to the module's calling convention."""

    cls: str
    target: str
    args: Callable[[nn.Module], dict]
    adapter: Callable[[nn.Module], None] | None = None
    state: Callable[[dict], dict] | None = None
    unstate: Callable[[dict], dict] | None = None


_TF = "transformers.models"
MATCHES: list[Match] = [
    # kb-nano baselines (the kb-nano calling convention: no adapter)
    Match("kb_nano.operators.norms:RMSNorm", "rms_norm", _norm_args),
    Match("kb_nano.operators.activations:SiluAndMul", "silu_and_mul", _no_args),
    Match("kb_nano.operators.rotary:RotaryEmbedding", "rotary_embedding", _rotary_args),
    Match("kb_nano.operators.embedding:VocabParallelEmbedding", "embedding", _embedding_args),
    Match("kb_nano.operators.mlp:LlamaMLP", "mlp", _mlp_args),
    Match("kb_nano.operators.layers:DecoderLayer", "decoder_layer", _recorded_args),
    Match("kb_nano.operators.layers:CausalLM", "model", _recorded_args),
    # transformers modules
    Match(f"{_TF}.llama.modeling_llama:LlamaRMSNorm", "rms_norm", _norm_args, _tokens_adapter),
    Match(f"{_TF}.qwen3.modeling_qwen3:Qwen3RMSNorm", "rms_norm", _norm_args, _tokens_adapter),
    Match(f"{_TF}.llama.modeling_llama:LlamaMLP", "mlp", _hf_mlp_args, _tokens_adapter, _hf_mlp_state, _hf_mlp_unstate),
    Match(f"{_TF}.qwen3.modeling_qwen3:Qwen3MLP", "mlp", _hf_mlp_args, _tokens_adapter, _hf_mlp_state, _hf_mlp_unstate),
    Match(f"{_TF}.llama.modeling_llama:LlamaDecoderLayer", "decoder_layer", _hf_layer_args, _hf_decoder_layer_adapter),
    Match(f"{_TF}.qwen3.modeling_qwen3:Qwen3DecoderLayer", "decoder_layer", _hf_layer_args, _hf_decoder_layer_adapter),
]


def _resolve(path: str):
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def active_matches(table: list[Match] | None = None) -> dict[type, Match]:
    """The usable rows of ``table`` (default :data:`MATCHES`) by class: rows of unregistered
    targets or unimportable classes are left out."""
    out = {}
    for row in MATCHES if table is None else table:
        if row.target not in operators.CATALOG:
            continue
        cls = _resolve(row.cls)
        if cls is not None:
            out[cls] = row
    return out
