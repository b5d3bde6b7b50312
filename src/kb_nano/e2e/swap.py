"""Kernel swapper: put candidate kernels into a model's module tree.

:func:`apply` replaces the modules of a model that a candidate's target covers, bottom-up
(docs/architecture.md, "Candidates"):

1. Candidates are sorted by level (L1 single ops, then L2 blocks, L3 decoder layers, L4 the
   model). At most one candidate per target.
2. Matching is by exact module class through :data:`kb_nano.e2e.swap_matches.MATCHES`, a table from module classes
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

import warnings
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from kb_nano import operators
from kb_nano.candidates import CandidateRef, load_class
from kb_nano.e2e.swap_matches import Match, SwapError, active_matches


class SubsumptionWarning(UserWarning):
    """A higher-level candidate replaced a module whose subtree held lower-level candidates."""


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
        found = [
            (path, module, rows[type(module)])
            for path, module in _baseline_modules(result.model)
            if type(module) in rows and rows[type(module)].target == target
        ]
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
        p: lower
        for p, lower in result.active.items()
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
