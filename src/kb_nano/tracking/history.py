"""``kb_nano history``: past runs and run-to-run comparisons, read through the MLflow client.

:func:`list_runs` searches the ``kb_nano/{tier}`` experiments (FINISHED runs, newest
first) and filters by target, candidate, model; :func:`compare_runs` downloads the merged
rows artifact of two runs and lines up per-scenario speedups. Both read the tracking
store (SQLite or a server) through ``mlflow.MlflowClient``, never the results files.
"""

from __future__ import annotations

import json
import math
import tempfile
from datetime import datetime
from pathlib import Path

from rich.table import Table

from kb_nano.errors import KbNanoError
from kb_nano.tracking import (
    CANDIDATE_TAG_PREFIX,
    ROWS_ARTIFACT,
    TIERS,
    client,
    experiment_name,
    sqlite_path,
)

# Tier -> (fields identifying a comparable row, value compared).
COMPARE_KEYS = {"kernels": (("scenario_id", "candidate"), "speedup")}
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
            "attributes.status = 'FINISHED'",
            max_results=PAGE,
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
    """The kb-nano run whose id is ``ref`` or starts with ``ref`` (at least 4 characters).
    Raises ``KbNanoError`` when none or several match."""
    from mlflow.exceptions import MlflowException

    ref = ref.strip()
    if len(ref) == 32:
        try:
            return mlflow_client.get_run(ref)
        except MlflowException:
            pass
    if len(ref) >= 4:
        exps = _experiments(mlflow_client, None)
        hits, token = [], None
        while exps:
            page = mlflow_client.search_runs(list(exps), "", max_results=1000, page_token=token)
            hits += [r for r in page if r.info.run_id.startswith(ref)]
            token = page.token
            if not token:
                break
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise KbNanoError(f"--compare: run id prefix {ref!r} is ambiguous ({len(hits)} runs); give more characters")
    if len(ref) < 4:
        raise KbNanoError(
            f"--compare: run id prefix {ref!r} is too short; give at least 4 characters (see `kb_nano history`)"
        )
    raise KbNanoError(f"--compare: no kb-nano run {ref!r} in {tracking_uri}; see `kb_nano history`")


def _run_rows(tracking_uri: str, run) -> list[dict]:
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    tier = run.data.tags.get("kb_nano.tier")
    path = run.data.tags.get("kb_nano.rows_artifact") or ROWS_ARTIFACT.get(tier or "")
    if not path:
        raise KbNanoError(f"--compare: run {run.info.run_id} has no kb-nano rows artifact (tier {tier!r})")
    with tempfile.TemporaryDirectory(prefix="kb_nano_compare_") as tmp:
        try:
            local = mlflow.artifacts.download_artifacts(
                run_id=run.info.run_id, artifact_path=path, dst_path=tmp, tracking_uri=tracking_uri
            )
        except (MlflowException, OSError) as exc:
            raise KbNanoError(
                f"--compare: cannot read {path} of run {run.info.run_id}: {' '.join(str(exc).split())[:200]}"
            ) from None
        return json.loads(Path(local).read_text())["rows"]


def compare_runs(tracking_uri: str, run_a: str, run_b: str) -> dict:
    """Per-scenario comparison of two runs of the same tier (ids or unique prefixes).

    Returns ``{"a": summary, "b": summary, "rows": [...]}``; each row has the key fields
    (kernels: scenario_id, candidate), ``status_a``/``status_b``, ``speedup_a``/
    ``speedup_b`` (None where not passed or absent) and ``change`` = speedup_b / speedup_a
    - 1 (a fraction; None unless both passed). Rows whose status changed come first,
    then the largest relative changes (either direction), then rows without a change. Raises ``KbNanoError`` for an unknown run,
    runs of different tiers, or an unreachable server.
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
    rows_a = {tuple(r[k] for k in keys): r for r in _run_rows(tracking_uri, ra)}
    rows_b = {tuple(r[k] for k in keys): r for r in _run_rows(tracking_uri, rb)}

    def val(r):
        if r is None or r.get("status") != "passed":
            return None
        v = r.get(value)
        return v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None

    out = []
    for key in list(rows_a) + [k for k in rows_b if k not in rows_a]:
        a, b = rows_a.get(key), rows_b.get(key)
        va, vb = val(a), val(b)
        out.append(
            {
                **dict(zip(keys, key)),
                "status_a": a["status"] if a else None,
                "status_b": b["status"] if b else None,
                f"{value}_a": va,
                f"{value}_b": vb,
                "change": vb / va - 1 if va and vb else None,
            }
        )
    out.sort(
        key=lambda r: (
            r["status_a"] == r["status_b"],
            r["change"] is None,
            -abs(r["change"] or 0.0),
            *(str(r[k]) for k in keys),
        )
    )
    return {"tier": ta, "a": _summary(ra, ta), "b": _summary(rb, tb), "rows": out}


# ----------------------------------------------------------------------------- tables


def _fmt(value, fmt: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt) + suffix


def _candidates_text(cands: list[str], width: int = 3) -> str:
    if len(cands) <= width:
        return ", ".join(cands)
    return f"{len(cands)}: " + ", ".join(cands[:width]) + ", …"


def history_table(runs: list[dict], title: str = "kb-nano history") -> Table:
    """Rich table of :func:`list_runs` results: run (id prefix), time, tier, candidates,
    scenarios run, pass rate, geometric-mean speedup over passed rows, git sha."""
    table = Table(title=title)
    for col, justify in (
        ("run", "left"),
        ("time", "left"),
        ("tier", "left"),
        ("candidates", "left"),
        ("rows run", "right"),
        ("pass rate", "right"),
        ("geomean speedup", "right"),
        ("git sha", "left"),
    ):
        table.add_column(col, justify=justify, overflow="fold", no_wrap=col in ("run", "time"))
    for r in runs:
        rate = r["pass_rate"]
        table.add_row(
            r["run_id"][:12],
            r["start_time"].strftime("%Y-%m-%d %H:%M:%S"),
            r["tier"],
            _candidates_text(r["candidates"]),
            _fmt(r["scenarios_run"], ".0f"),
            _fmt(rate * 100 if rate is not None else None, ".0f", "%"),
            _fmt(r["geomean_speedup"], ".3f", "x"),
            (r["git_sha"] or "-")[:12] + ("-dirty" if (r["git_sha"] or "").endswith("-dirty") else ""),
        )
    return table


def compare_table(result: dict) -> Table:
    """Rich table of :func:`compare_runs`: one line per scenario × candidate with both
    statuses, both speedups and the relative change (red: slower by > 5 %, green: faster
    by > 5 %)."""
    a, b = result["a"], result["b"]
    table = Table(
        title=f"kb-nano compare: A={a['run_id'][:12]} ({a['start_time']:%Y-%m-%d %H:%M}) "
        f"→ B={b['run_id'][:12]} ({b['start_time']:%Y-%m-%d %H:%M})"
    )
    for col, justify in (
        ("scenario", "left"),
        ("candidate", "left"),
        ("status A", "left"),
        ("status B", "left"),
        ("speedup A", "right"),
        ("speedup B", "right"),
        ("change", "right"),
    ):
        table.add_column(col, justify=justify, overflow="fold")
    for r in result["rows"]:
        change = r["change"]
        text = _fmt(change * 100 if change is not None else None, "+.1f", "%")
        if change is not None and abs(change) > 0.05:
            style = "green" if change > 0 else "red"
            text = f"[{style}]{text}[/{style}]"
        status_b = r["status_b"] or "absent"
        if r["status_a"] != r["status_b"]:
            status_b = f"[bold]{status_b}[/bold]"
        table.add_row(
            r["scenario_id"],
            r["candidate"],
            r["status_a"] or "absent",
            status_b,
            _fmt(r["speedup_a"], ".3f", "x"),
            _fmt(r["speedup_b"], ".3f", "x"),
            text,
        )
    return table
