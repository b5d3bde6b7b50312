"""``kb_nano history``: past runs and run-to-run comparisons, read through the MLflow client.

:func:`list_runs` searches the ``kb_nano/{tier}`` experiments (FINISHED runs, newest
first) and filters by target, candidate, model; :func:`compare_runs` downloads the merged
rows artifact of two runs and lines up the rows both have, with the significance of
each speedup change (:func:`significance`). Both read the tracking store (SQLite or a
server) through ``mlflow.MlflowClient``, never the results files. The tables are in
:mod:`kb_nano.tracking.history_tables`.
"""

from __future__ import annotations

import math
from datetime import datetime

from kb_nano.errors import KbNanoError
from kb_nano.tracking import (
    CANDIDATE_TAG_PREFIX,
    TIERS,
    client,
    experiment_name,
    sqlite_path,
)
from kb_nano.tracking.recorded import ROW_KEYS, run_rows, same_measurement
from kb_nano.tracking.selection import in_selection, narrowed, run_selection

# Tier -> (fields identifying a comparable row, value compared).
COMPARE_KEYS = {"kernels": (ROW_KEYS["kernels"], "speedup")}
PAGE = 200


def store_exists(tracking_uri: str) -> bool:
    """False only for an SQLite store whose database file does not exist yet."""
    db = sqlite_path(tracking_uri)
    return db is None or db.is_file()


def _split(text: str | None) -> list[str]:
    return [t for t in (text or "").split(",") if t]


def _summary(run, tier: str) -> dict:
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    candidates = _split(tags.get("kb_nano.candidates")) or sorted(
        k[len(CANDIDATE_TAG_PREFIX) :] for k in tags if k.startswith(CANDIDATE_TAG_PREFIX)
    )
    return {
        "run_id": run.info.run_id,
        "run_name": run.info.run_name,
        "tier": tier,
        "start_time": datetime.fromtimestamp(run.info.start_time / 1000).astimezone(),
        "candidates": candidates,
        "targets": _split(tags.get("kb_nano.targets")),
        "models": _split(tags.get("kb_nano.models")),
        "scenarios_run": metrics.get("scenarios_run"),
        "rows": metrics.get("rows"),
        "pass_rate": metrics.get("pass_rate"),
        "geomean_speedup": metrics.get("geomean_speedup"),
        "git_sha": params.get("git_sha"),
        "digest": tags.get("kb_nano.digest"),
    }


def _matches(summary: dict, target: str | None, candidate: str | None, model: str | None) -> bool:
    if target and target not in summary["targets"]:
        return False
    if candidate and not any(c == candidate or c.startswith(candidate) for c in summary["candidates"]):
        return False
    if model and not any(m == model or m.startswith(model) for m in summary["models"]):
        return False
    return True


def _experiments(mlflow_client, tier: str | None) -> dict[str, str]:
    """``{experiment id: tier}`` of the kb-nano experiments that exist."""
    out = {}
    for t in [tier] if tier else TIERS:
        exp = mlflow_client.get_experiment_by_name(experiment_name(t))
        if exp is not None and exp.lifecycle_stage == "active":
            out[exp.experiment_id] = t
    return out


def _run_filter(target: str | None, model: str | None) -> str:
    """The search filter of :func:`list_runs`: FINISHED runs, narrowed in the store by
    target and model (a ``LIKE`` on the comma-joined tags; :func:`_matches` then checks
    exactly). A run holds every per-scenario metric, so the fewer runs the store returns
    the faster ``kb_nano history`` answers."""
    clauses = ["attributes.status = 'FINISHED'"]
    for tag, value in (("kb_nano.targets", target), ("kb_nano.models", model)):
        if value and not any(ch in value for ch in "'\\%"):
            clauses.append(f"tags.`{tag}` LIKE '%{value}%'")
    return " and ".join(clauses)


def list_runs(
    tracking_uri: str,
    *,
    tier: str | None = None,
    target: str | None = None,
    candidate: str | None = None,
    model: str | None = None,
    limit: int = 20,
) -> list[dict]:
    """Recorded runs, newest first, at most ``limit`` (>= 1).

    Filters: ``tier`` (kernels|e2e|eval; default all), ``target`` (exact operator name),
    ``candidate`` (id or id prefix, e.g. ``rms_norm/`` or ``rms_norm/torch_fused``),
    ``model`` (model key or key prefix, ``llama31``). Each run is a dict with run_id,
    run_name, tier, start_time (local datetime), candidates, targets, models,
    scenarios_run, rows, pass_rate (0..1), geomean_speedup, git_sha, digest.
    An SQLite store that does not exist yet has no runs. Raises ``KbNanoError`` for an
    unknown tier, a bad limit or an unreachable server.
    """
    if limit < 1:
        raise KbNanoError(f"--limit must be at least 1 (got {limit})")
    if tier is not None:
        experiment_name(tier)
    if not store_exists(tracking_uri):
        return []
    c = client(tracking_uri)
    exps = _experiments(c, tier)
    if not exps:
        return []
    found: list[dict] = []
    token = None
    while len(found) < limit:
        page = c.search_runs(
            list(exps),
            _run_filter(target, model),
            max_results=PAGE if candidate else min(PAGE, limit),
            order_by=["attributes.start_time DESC"],
            page_token=token,
        )
        for run in page:
            s = _summary(run, exps[run.info.experiment_id])
            if _matches(s, target, candidate, model):
                found.append(s)
        token = page.token
        if not token:
            break
    return found[:limit]


def resolve_run(mlflow_client, ref: str, tracking_uri: str = "the tracking store"):
    """The kb-nano run whose id is ``ref`` or starts with ``ref`` (at least 4 characters),
    or whose name (in the MLflow UI) is ``ref``. Raises ``KbNanoError`` when none or
    several match."""
    from mlflow.exceptions import MlflowException

    ref = ref.strip()
    if len(ref) == 32:
        try:
            return mlflow_client.get_run(ref)
        except MlflowException:
            pass
    if len(ref) >= 4 and "'" not in ref and "\\" not in ref:
        exps = list(_experiments(mlflow_client, None))
        wheres = [f"attributes.run_name = '{ref}'"]
        if all(ch in "0123456789abcdef" for ch in ref.lower()):  # run ids are lowercase hex
            wheres.append(f"attributes.run_id LIKE '{ref.lower()}%'")
        found = {}
        for where in wheres:  # in the store: every run holds all its per-scenario metrics
            token = None
            while exps:
                page = mlflow_client.search_runs(exps, where, max_results=100, page_token=token)
                found.update((r.info.run_id, r) for r in page)
                token = page.token
                if not token:
                    break
        hits = list(found.values())
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise KbNanoError(f"--compare: run id prefix {ref!r} is ambiguous ({len(hits)} runs); give more characters")
    if len(ref) < 4:
        raise KbNanoError(
            f"--compare: run id prefix {ref!r} is too short; give at least 4 characters (see `kb_nano history`)"
        )
    raise KbNanoError(f"--compare: no kb-nano run {ref!r} in {tracking_uri}; see `kb_nano history`")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def significance(ci_a: tuple | None, ci_b: tuple | None) -> str | None:
    """Whether B's speedup differs from A's, from the two rows' 95% rerun intervals
    ``(low, high)``: ``"faster"`` when B's interval lies wholly above A's, ``"slower"``
    when wholly below, ``"no"`` when they overlap, None when either row has no interval.
    Conservative: two 95% intervals that do not overlap mean a difference well beyond
    the 5% level, while some real differences have overlapping intervals."""
    if ci_a is None or ci_b is None:
        return None
    if ci_b[0] > ci_a[1]:
        return "faster"
    if ci_b[1] < ci_a[0]:
        return "slower"
    return "no"


def compare_runs(tracking_uri: str, run_a: str, run_b: str) -> dict:
    """Per-row comparison of two runs of the same tier (ids or unique prefixes).

    Only rows present in both runs are compared (kernels: same scenario_id and
    candidate). Returns ``{"tier", "a": summary, "b": summary, "rows", "added",
    "removed", "not_selected_by_a", "not_selected_by_b", "narrowed_a", "narrowed_b",
    "summary"}``. Each of ``rows`` has the key fields, ``status_a``/``status_b``,
    ``speedup_a``/``speedup_b`` and ``ci_a``/``ci_b`` (the 95% rerun interval as
    ``(low, high)``; None where not passed or not measured), ``change`` = speedup_b /
    speedup_a - 1 (a fraction; None unless both passed), ``significant``
    (:func:`significance`: faster, slower, no, None), ``same_measurement`` (one shard
    reused by both runs) and ``candidate_changed`` (the candidate's source hash differs:
    a speedup change then reflects the edit). Rows whose status changed come first, then
    significant changes, then the largest relative changes.

    A row only one run has is ``removed`` (only in A) when B's selection
    (:func:`kb_nano.tracking.selection.run_selection`: its targets, models, TPs, token
    counts, variants, candidates) includes it, else ``not_selected_by_b``; likewise
    ``added`` (only in B) or ``not_selected_by_a``. Each holds the key fields and
    ``status``; ``narrowed_b`` says where B's selection is narrower than A's (e.g.
    ``targets rms_norm``), ``narrowed_a`` the reverse. ``summary`` counts compared, faster,
    slower (significant), no_interval, status_changed, same_measurement,
    candidate_changed, added, removed, not_selected_by_a and not_selected_by_b. Raises
    ``KbNanoError`` for an unknown run, runs of different tiers, or an unreachable server.
    """
    if not store_exists(tracking_uri):
        raise KbNanoError(f"--compare: no MLflow store at {tracking_uri} yet; run `kb_nano kernels` first")
    c = client(tracking_uri)
    ra, rb = resolve_run(c, run_a, tracking_uri), resolve_run(c, run_b, tracking_uri)
    ta, tb = ra.data.tags.get("kb_nano.tier"), rb.data.tags.get("kb_nano.tier")
    if ta != tb:
        raise KbNanoError(f"--compare: runs are of different tiers ({ta} vs {tb})")
    if ta not in COMPARE_KEYS:
        raise KbNanoError(f"--compare: comparing {ta!r} runs is not supported yet")
    keys, value = COMPARE_KEYS[ta]
    rows_a = {tuple(r[k] for k in keys): r for r in run_rows(tracking_uri, ra)}
    rows_b = {tuple(r[k] for k in keys): r for r in run_rows(tracking_uri, rb)}

    def val(r):
        v = r.get(value) if r.get("status") == "passed" else None
        return v if _finite(v) and v > 0 else None

    def ci(r):
        lo, hi = (r.get(f"{value}_ci_low"), r.get(f"{value}_ci_high")) if r.get("status") == "passed" else (None, None)
        return (lo, hi) if _finite(lo) and _finite(hi) else None

    out = []
    for key in [k for k in rows_a if k in rows_b]:
        a, b = rows_a[key], rows_b[key]
        va, vb = val(a), val(b)
        sha_a, sha_b = a.get("candidate_sha256"), b.get("candidate_sha256")
        out.append(
            {
                **dict(zip(keys, key)),
                "status_a": a["status"],
                "status_b": b["status"],
                f"{value}_a": va,
                f"{value}_b": vb,
                "ci_a": ci(a),
                "ci_b": ci(b),
                "change": vb / va - 1 if va and vb else None,
                "significant": significance(ci(a), ci(b)) if va and vb else None,
                # the same shard in both runs (one measurement, e.g. a filtered rerun): no change to judge
                "same_measurement": same_measurement(a, b),
                # the candidate file was edited between the runs: a change reflects the edit, not noise
                "candidate_changed": bool(sha_a and sha_b and sha_a != sha_b),
            }
        )
    out.sort(
        key=lambda r: (
            r["status_a"] == r["status_b"],
            r["significant"] not in ("faster", "slower"),
            r["change"] is None,
            -abs(r["change"] or 0.0),
            *(str(r[k]) for k in keys),
        )
    )
    sel_a, sel_b = run_selection(ra), run_selection(rb)

    def only(mine: dict, other: dict, other_sel: dict, selected: bool) -> list[dict]:
        return [
            {**dict(zip(keys, k)), "status": mine[k]["status"]}
            for k in sorted(mine)
            if k not in other and in_selection(mine[k], other_sel) == selected
        ]

    both_passed = [r for r in out if r["change"] is not None]
    summary = {
        "compared": len(out),
        "faster": sum(r["significant"] == "faster" for r in out),
        "slower": sum(r["significant"] == "slower" for r in out),
        "no_interval": sum(r["significant"] is None for r in both_passed),
        "status_changed": sum(r["status_a"] != r["status_b"] for r in out),
        "same_measurement": sum(r["same_measurement"] for r in out),
        "candidate_changed": sum(r["candidate_changed"] for r in out),
    }
    parts = {
        "added": only(rows_b, rows_a, sel_a, True),
        "removed": only(rows_a, rows_b, sel_b, True),
        "not_selected_by_a": only(rows_b, rows_a, sel_a, False),
        "not_selected_by_b": only(rows_a, rows_b, sel_b, False),
    }
    summary.update({name: len(rs) for name, rs in parts.items()})
    return {
        "tier": ta,
        "a": _summary(ra, ta),
        "b": _summary(rb, tb),
        "rows": out,
        **parts,
        "narrowed_a": narrowed(sel_b, sel_a),
        "narrowed_b": narrowed(sel_a, sel_b),
        "summary": summary,
    }


def compare_summary(result: dict) -> str:
    """The one-line summary of :func:`compare_runs`: rows compared (present in both
    runs), significantly faster and slower (95% rerun intervals apart), status changes,
    rows whose candidate source changed, rows that are one measurement in both (a reused
    shard), how many rows only one run has (added, removed), and how many rows a run's
    selection did not include (with where that selection is narrower)."""
    s = result["summary"]
    text = (
        f"{s['compared']} rows in both runs compared: {s['faster']} significantly faster, {s['slower']} "
        f"significantly slower (95% rerun intervals apart), {s['status_changed']} status changes"
    )
    if s.get("candidate_changed"):
        text += f"; {s['candidate_changed']} of them with a changed candidate source (the change reflects the edit)"
    if s.get("same_measurement"):
        text += f"; {s['same_measurement']} of them the same measurement in both runs (a shard both reused)"
    if s["no_interval"]:
        text += f"; {s['no_interval']} passed in both without a rerun interval"
    text += f"; {s['added']} rows only in B (added), {s['removed']} only in A (removed)"
    for mine, other in (("A", "B"), ("B", "A")):
        n = s.get(f"not_selected_by_{other.lower()}")
        if n:
            how = result.get(f"narrowed_{other.lower()}")
            text += f"; {n} rows of {mine} not in {other}'s selection{f' ({how})' if how else ''}, not compared"
    return text
