"""Kernel swapper: put candidate kernels into a model's module tree.

:func:`apply` replaces the modules of a model that a candidate's target covers, bottom-up
(docs/architecture.md, "Candidates"):

1. Candidates are sorted by level (L1 single ops, then L2 blocks, L3 decoder layers, L4 the
   model). At most one candidate per target.
2. Matching is by exact module class through :data:`MATCHES`, a table from module classes
   (transformers' ``LlamaRMSNorm``, ``LlamaDecoderLayer``, ...; kb-nano's baselines
   ``RMSNorm``, ``DecoderLayer``, ...) to kb-nano targets. The table is data: entries whose
   target is not registered in :data:`kb_nano.operators.CATALOG`, or whose class cannot be
   imported, are ignored. A candidate class is never matched again, even if it subclasses a
   baseline (matching is ``type(module) is cls``).
3. For each matched module the candidate is constructed with arguments derived from that
   module (e.g. ``hidden_size`` and ``eps`` from an RMSNorm's weight and
   ``variance_epsilon``), gets the module's weights with ``load_state_dict(strict=True)``
   (mapped to the target's keys where the table says so: transformers' ``gate_proj`` and
   ``up_proj`` become vLLM's ``gate_up_proj`` for ``mlp``, and back when a higher-level
   candidate takes over), takes its device, dtype and train/eval mode, and replaces it in
   its parent. The candidate is marked (attribute ``kb_nano_swap``): its own submodules are
   never matched, and a later :func:`apply` on the same model knows it is there.
4. **Subsumption:** when a candidate replaces a module whose subtree already holds
   candidates of a lower level (an L3 decoder-layer candidate over an L1 ``rms_norm``
   candidate in ``input_layernorm``), those lower candidates no longer run there. The
   swapper emits one :class:`SubsumptionWarning` per replaced module naming both
   candidate ids and the module paths, and drops the lower entries from the active map.

Calling conventions: a candidate has the kb-nano baseline's forward (``DecoderLayer``:
``forward(hidden_states [N, H], positions [N])``). Where the replaced module is called
with another convention (a transformers ``*DecoderLayer`` inside a transformers model gets
``[B, S, H]`` plus mask, position ids and rotary tables), the table entry names an adapter
that overrides ``forward`` on that candidate instance (the module keeps its class and state
dict keys). The transformers decoder-layer adapter supports causal prefill without padding
and without a KV cache, and raises otherwise.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from kb_nano import operators
from kb_nano.candidates import CandidateRef, load_class
from kb_nano.errors import KbNanoError


class SubsumptionWarning(UserWarning):
    """A higher-level candidate replaced a module whose subtree held lower-level candidates."""


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
            out.update({f"gate_proj.{kind}": gate, f"up_proj.{kind}": up, f"down_proj.{kind}": state[f"down_proj.{kind}"]})
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

    def forward(hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, past_key_values=None, **kwargs):
        batch, seq_len = hidden_states.shape[:2]
        if cache is not None or past_key_values is not None:
            raise NotImplementedError(f"{type(module).__name__} (swapped in by kb_nano.swap) does not support a KV cache")
        if not _is_plain_causal(attention_mask, seq_len):
            raise NotImplementedError(f"{type(module).__name__} (swapped in by kb_nano.swap) supports only a causal mask without padding")
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


# --------------------------------------------------------------------------- apply


@dataclass(frozen=True)
class Subsumed:
    """``lower`` (candidate id) at ``lower_path`` stopped running when ``higher`` replaced
    the module at ``higher_path`` (an ancestor, or the same path)."""

    lower: str
    lower_path: str
    higher: str
    higher_path: str


@dataclass
class SwapResult:
    """Outcome of :func:`apply`.

    Attributes:
        model: the model after swapping (the same object unless the root itself was replaced).
        active: ``{module_path: candidate_id}`` of the candidates that run, by module path
            (``""`` is the root).
        subsumed: lower-level candidates that a higher-level one replaced.
    """

    model: nn.Module
    active: dict[str, str] = field(default_factory=dict)
    subsumed: list[Subsumed] = field(default_factory=list)


def _as_pair(candidate) -> tuple[str, type]:
    if isinstance(candidate, CandidateRef):
        return candidate.id, load_class(Path(candidate.path), candidate.target)
    cid, cls = candidate
    return str(cid), cls


def _show(path: str) -> str:
    return path or "<root>"


def _like(module: nn.Module):
    """Device and floating dtype of a module (its first floating parameter or buffer)."""
    for t in (*module.parameters(), *module.buffers()):
        if t.is_floating_point():
            return t.device, t.dtype
    for t in (*module.parameters(), *module.buffers()):
        return t.device, None
    return None, None


def _baseline_state(old: nn.Module, path: str, swapped: dict[str, Match]) -> dict:
    """``old.state_dict()`` with the keys of candidates swapped in below ``path`` mapped back to
    the keys of the modules they replaced (the layout ``old``'s own baseline has)."""
    state = old.state_dict()
    for p, row in swapped.items():
        if row.unstate is None or not (not path or p.startswith(path + ".")):
            continue
        rel = p[len(path) + 1 :] if path else p
        inner = {k[len(rel) + 1 :]: v for k, v in state.items() if k.startswith(rel + ".")}
        state = {k: v for k, v in state.items() if not k.startswith(rel + ".")}
        state.update({f"{rel}.{k}": v for k, v in row.unstate(inner).items()})
    return state


def _build(cid: str, cls: type, row: Match, old: nn.Module, path: str, swapped: dict[str, Match]) -> nn.Module:
    try:
        args = row.args(old)
    except SwapError as exc:
        raise SwapError(f"{cid} at {_show(path)}: {exc}") from None
    try:
        new = cls(**args)
    except Exception as exc:
        raise SwapError(f"{cid} at {_show(path)}: constructor {cls.__name__}(**{sorted(args)}) failed: {exc}") from exc
    device, dtype = _like(old)
    state = _baseline_state(old, path, swapped)
    if row.state is not None:
        state = row.state(state)
    try:
        new.load_state_dict(state, strict=True)
    except Exception as exc:
        raise SwapError(f"{cid} at {_show(path)}: state_dict does not match {type(old).__name__}'s: {exc}") from exc
    if device is not None:
        new = new.to(device=device, dtype=dtype) if dtype is not None else new.to(device=device)
    new.train(old.training)
    if row.adapter is not None:
        row.adapter(new)
    return new


def _replace(root: nn.Module, path: str, new: nn.Module) -> nn.Module:
    if not path:
        return new
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)
    return root


def apply(model: nn.Module, candidates: list, table: list[Match] | None = None) -> SwapResult:
    """Apply ``candidates`` to ``model`` bottom-up (L1 -> L4) and return a :class:`SwapResult`.

    ``candidates``: ``(candidate_id, class)`` pairs (id ``{target}/{name}``) or
    :class:`~kb_nano.candidates.CandidateRef` (loaded with
    :func:`~kb_nano.candidates.load_class`). ``model`` is modified in place (replacing its
    root returns a new object in ``SwapResult.model``). Emits a :class:`SubsumptionWarning`
    per replaced module whose subtree held lower-level candidates. A candidate whose target
    matches no module is simply not active.

    Raises ``SwapError`` for two candidates of one target, an unknown target, or a matched
    module the candidate cannot replace (arguments, constructor, state dict).
    """
    rows = active_matches(table)
    pairs = [_as_pair(c) for c in candidates]
    by_target: dict[str, tuple[str, type]] = {}
    for cid, cls in pairs:
        target = cid.split("/", 1)[0]
        operators.check_target(target, where=f"candidate {cid}")
        if target in by_target:
            raise SwapError(f"two candidates for target {target}: {by_target[target][0]} and {cid}")
        by_target[target] = (cid, cls)
    order = sorted(by_target, key=lambda t: (operators.CATALOG[t].level, list(operators.CATALOG).index(t)))
    result = SwapResult(model=model)
    # candidates already in the tree (an earlier apply) count as active: path -> (id, row)
    swapped: dict[str, Match] = {}
    for path, (cid, row) in _marked(model).items():
        result.active[path] = cid
        swapped[path] = row
    for target in order:
        cid, cls = by_target[target]
        level = operators.CATALOG[target].level
        found = [(path, module, rows[type(module)]) for path, module in _baseline_modules(result.model)
                 if type(module) in rows and rows[type(module)].target == target]
        # outermost first; a match nested in an earlier match of this target is replaced with it
        done: list[str] = []
        for path, module, row in found:
            if any(path == d or path.startswith(d + ".") or not d for d in done):
                continue
            new = _build(cid, cls, row, module, path, swapped)
            setattr(new, _MARK, (cid, row))
            result.model = _replace(result.model, path, new)
            for inside in [q for q in swapped if not path or q == path or q.startswith(path + ".")]:
                del swapped[inside]  # no longer in the tree
            swapped[path] = row
            done.append(path)
            _subsume(result, cid, level, path)
            result.active[path] = cid
    return result


_MARK = "kb_nano_swap"  # attribute of a swapped-in module: (candidate id, table row)


def _marked(model: nn.Module) -> dict[str, tuple[str, Match]]:
    return {path: getattr(m, _MARK) for path, m in model.named_modules() if hasattr(m, _MARK)}


def _baseline_modules(module: nn.Module, prefix: str = ""):
    """``named_modules()`` without swapped-in candidates and their subtrees: a candidate's own
    submodules are its business (it may read their weights without calling them)."""
    if hasattr(module, _MARK):
        return
    yield prefix, module
    for name, child in module.named_children():
        yield from _baseline_modules(child, f"{prefix}.{name}" if prefix else name)


def _subsume(result: SwapResult, cid: str, level: int, path: str) -> None:
    inside = {
        p: lower for p, lower in result.active.items()
        if (p == path or not path or p.startswith(path + "."))
        and operators.CATALOG[lower.split("/", 1)[0]].level < level
    }
    if not inside:
        return
    by_lower: dict[str, list[str]] = {}
    for p, lower in inside.items():
        by_lower.setdefault(lower, []).append(p)
        result.subsumed.append(Subsumed(lower, p, cid, path))
        del result.active[p]
    names = "; ".join(f"{lower} at {', '.join(_show(p) for p in paths)}" for lower, paths in by_lower.items())
    warnings.warn(
        f"{cid} replaces {_show(path)}, which held lower-level candidates that no longer run there: {names}",
        SubsumptionWarning,
        stacklevel=3,
    )
