"""What a logged kernel run selected, read back from its params and tags.

A kernels run logs the targets, models, TPs, token counts and variants its rows span
(params ``targets``, ``models``, ``tp``, ``num_tokens``, ``variants``) and the config's
candidate filter (``candidates_selected``; older runs: the candidates of their rows, tag
``kb_nano.candidates``). The sweep is their product, so a row another run has lies
within a run's selection when each of its fields is among them. ``kb_nano history
--compare`` tells that way a row a filtered rerun did not select from one it lost.
"""

from __future__ import annotations

from kb_nano.tracking.store import MAX_PARAM_CHARS

# Selection dimension -> the run param listing it (comma-separated).
DIMENSIONS = {"target": "targets", "model": "models", "tp": "tp", "num_tokens": "num_tokens", "variant": "variants"}


def _values(text: str | None) -> frozenset[str] | None:
    """The comma-separated values of a param; None (no restriction) when the run did not
    log it or MLflow cut it at its length limit."""
    if text is None or len(text) >= MAX_PARAM_CHARS:
        return None
    return frozenset(v for v in text.split(",") if v)


def run_selection(run) -> dict[str, frozenset[str] | None]:
    """``{dimension: allowed values}`` of a kernels run (dimensions of :data:`DIMENSIONS`
    and ``candidate``; None = any value): from its params, and for ``candidate`` from
    ``candidates_selected`` (id prefixes; ``all`` = any) or, for runs logged before it
    existed, the ``kb_nano.candidates`` tag."""
    params, tags = run.data.params, run.data.tags
    sel = {dim: _values(params.get(param)) for dim, param in DIMENSIONS.items()}
    filt = params.get("candidates_selected")
    if filt is not None:
        sel["candidate"] = None if filt == "all" else _values(filt)
    else:
        sel["candidate"] = _values(tags.get("kb_nano.candidates"))
    sel["candidate_prefixes"] = filt is not None and filt != "all"
    return sel


def row_variant(row: dict) -> str:
    """A kernel row's variant: what its scenario id has beyond ``{target}__{model}__tp{tp}__n{num_tokens}``
    (``ctx1024``), else ``none`` (as :func:`kb_nano.tracking.kernels.variant_of` logs it)."""
    base = f"{row['target']}__{row['model']}__tp{row['tp']}__n{row['num_tokens']}__"
    sid = row["scenario_id"]
    return sid.removeprefix(base) if sid.startswith(base) else "none"


def in_selection(row: dict, sel: dict) -> bool:
    """Whether a kernel row lies within a run's selection (:func:`run_selection`)."""
    fields = {dim: str(row.get(dim)) for dim in DIMENSIONS if dim != "variant"}
    fields["variant"] = row_variant(row)
    for dim, value in fields.items():
        if sel[dim] is not None and value not in sel[dim]:
            return False
    cands, cand = sel["candidate"], str(row.get("candidate"))
    if cands is None:
        return True
    if sel["candidate_prefixes"]:
        return any(cand == c or cand.startswith(c) for c in cands)
    return cand in cands


def narrowed(sel_a: dict, sel_b: dict) -> str:
    """How ``sel_b`` is narrower than ``sel_a``, e.g. ``targets rms_norm; num_tokens 1``:
    each dimension where B allows values A has not all of, with B's values ("" when none).
    A dimension one of the runs did not log (an older run) is left out; for candidates
    None is every candidate."""
    parts = []
    for dim in (*DIMENSIONS, "candidate"):
        a, b = sel_a[dim], sel_b[dim]
        if b is not None and (not a <= b if a is not None else dim == "candidate"):
            name = DIMENSIONS.get(dim, "candidates")
            parts.append(f"{name} {', '.join(sorted(b, key=lambda v: (len(v), v)))}")
    return "; ".join(parts)
