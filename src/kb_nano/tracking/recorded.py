"""Which logged runs already hold a result set's measurements.

A row is one measurement of one candidate on one scenario; a row reused from an earlier
shard keeps its ``created_at``, ``seed`` and ``candidate_sha256``, so two runs holding
rows equal in those fields hold the same measurement (:func:`same_measurement`;
``kb_nano history --compare`` marks such rows ``same row``). :func:`recorded_in` finds
the run that holds every row of a result set, each row identical in every field: a
filtered rerun that measured nothing (every selected shard reused) then logs no run of
its own (:func:`kb_nano.tracking.kernels.log_kernels`). :func:`run_rows` reads a run's
merged rows back.
"""

from __future__ import annotations

import json
import math
import tempfile
from datetime import datetime, timedelta
from pathlib import Path

from kb_nano.errors import KbNanoError
from kb_nano.tracking.digest import canonical_rows
from kb_nano.tracking.store import (
    CANDIDATE_TAG_PREFIX,
    ROWS_ARTIFACT,
    _retry,
    four_digits,
    metric_name,
    row_metric_name,
)

# Tier -> the fields naming a row (one candidate on one scenario) across runs.
ROW_KEYS = {"kernels": ("scenario_id", "candidate")}
# The fields a reused row keeps from the shard that measured it.
MEASUREMENT_FIELDS = ("created_at", "seed", "candidate_sha256")
# How far a run's start may precede a row's created_at and still hold it (clocks of the
# measuring node and the logging host may differ); only narrows the runs searched.
CLOCK_SLACK = timedelta(hours=1)
PAGE = 100


def same_measurement(a: dict, b: dict) -> bool:
    """Whether two rows are one measurement (the same shard reused by two runs): the same
    ``created_at``, ``seed`` and ``candidate_sha256`` (a row without ``created_at`` is
    never the same as another)."""
    return bool(a.get("created_at")) and all(a.get(k) == b.get(k) for k in MEASUREMENT_FIELDS)


def run_rows(tracking_uri: str, run, what: str = "--compare") -> list[dict]:
    """The merged rows a run logged (its ``kb_nano.rows_artifact``, e.g.
    ``results/kernels.json``), downloaded through MLflow. Raises ``KbNanoError`` (starting
    with ``what``) when the run has no such artifact or it cannot be read."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    tier = run.data.tags.get("kb_nano.tier")
    path = run.data.tags.get("kb_nano.rows_artifact") or ROWS_ARTIFACT.get(tier or "")
    if not path:
        raise KbNanoError(f"{what}: run {run.info.run_id} has no kb-nano rows artifact (tier {tier!r})")
    with tempfile.TemporaryDirectory(prefix="kb_nano_rows_") as tmp:
        try:
            local = mlflow.artifacts.download_artifacts(
                run_id=run.info.run_id, artifact_path=path, dst_path=tmp, tracking_uri=tracking_uri
            )
            return json.loads(Path(local).read_text())["rows"]
        except (MlflowException, OSError, ValueError, KeyError) as exc:
            raise KbNanoError(
                f"{what}: cannot read {path} of run {run.info.run_id}: {' '.join(str(exc).split())[:200]}"
            ) from None


def _created(row: dict) -> datetime | None:
    try:
        when = datetime.fromisoformat(str(row.get("created_at")))
    except ValueError:
        return None
    return when if when.tzinfo else None


def _canonical(row: dict) -> str:
    return json.dumps(canonical_rows([row])[0], sort_keys=True, default=str)


def _may_hold(run, row: dict, candidate_sha: str | None) -> bool:
    """A cheap check before downloading a run's rows: a run holding ``row`` lists its
    target, records the candidate source ``candidate_sha`` (when given), and has a passed
    row's per-row metric at the row's value (:func:`_probes`; so runs logged before
    kb-nano recorded per-row metrics hold no passed row)."""
    tags, metrics = run.data.tags, run.data.metrics
    if row.get("target") not in (tags.get("kb_nano.targets") or "").split(","):
        return False
    if candidate_sha is not None and tags.get(f"{CANDIDATE_TAG_PREFIX}{row.get('candidate')}") != candidate_sha:
        return False
    probes = _probes(row)
    return not probes or any(metrics.get(name) == value for name, value in probes)


def _newest_is_logged(mlflow_client, experiment_id: str, where: str, rows: list[dict]) -> bool:
    """False when the most recently measured passed row is certainly in no run: no run has
    its per-row metric at its value (:func:`_probes`: one query in the store per name; a
    row this invocation measured fails them, so a result set with a new row costs no scan
    of the runs). True when it may be logged or no passed row can be probed."""
    probed = [r for r in rows if _created(r) is not None and _probes(r)]
    if not probed:
        return True
    newest = max(probed, key=_created)
    return any(
        _retry(mlflow_client.search_runs, [experiment_id], f"{where} and metrics.`{name}` = {value!r}", max_results=1)
        for name, value in _probes(newest)
    )


def _probes(row: dict) -> list[tuple[str, float]]:
    """The per-row metrics a run holding a passed ``row`` logged for it, as ``(name,
    value)``: its speedup (:func:`~kb_nano.tracking.store.row_metric_name`), and the
    ``candidate_ms/<scenario_id>/<candidate>`` metric of runs logged while kb-nano recorded
    five metrics per row; each at the value kb-nano logs now (4 significant digits,
    :func:`~kb_nano.tracking.store.four_digits`) and at full precision (runs logged before
    metrics were rounded). Empty for a row that did not pass."""
    if row.get("status") != "passed":
        return []
    named = (
        (row_metric_name(row), row.get("speedup")),
        (metric_name("candidate_ms", row["scenario_id"], row["candidate"]), row.get("candidate_ms")),
    )
    probes = []
    for name, v in named:
        if isinstance(v, float) and math.isfinite(v):
            probes += [(name, four_digits(v))] + ([(name, v)] if four_digits(v) != v else [])
    return probes


def recorded_in(
    mlflow_client,
    tracking_uri: str,
    experiment_id: str,
    tier: str,
    rows: list[dict],
    candidate_hashes: dict[str, str | None] | None = None,
) -> list[dict]:
    """The newest FINISHED run of ``experiment_id`` that holds every one of ``rows``
    identically (every field: a measured row's ``created_at`` and ``seed`` with it, so the
    same measurement; a row no job measured, such as a scenario the model does not have,
    with its status and reason), as a one-item list ``[{run_id, run_name, rows}]``
    (``rows``: how many rows). With ``candidate_hashes`` (``{candidate id: source
    SHA-256}``) a run holds a row only if it recorded that source for the row's
    candidate. Empty when no single run holds them all, or ``rows`` is empty: a result
    set whose rows are spread over several runs (a full sweep after a filtered rerun) is
    a combination no run records, and is logged as a run of its own.

    Searches only runs that ended after the oldest row was measured (less
    :data:`CLOCK_SLACK`) and downloads a run's rows only when it may hold every row (its
    targets and candidate tags, its per-row metrics). Raises ``KbNanoError``
    when a run's rows cannot be read."""
    keys = ROW_KEYS[tier]
    hashes = candidate_hashes or {}
    need = {tuple(r.get(k) for k in keys): r for r in rows}
    if not need:
        return []
    times = [t for t in (_created(r) for r in need.values()) if t is not None]
    where = "attributes.status = 'FINISHED'"
    if times:
        where += f" and attributes.end_time >= {int((min(times) - CLOCK_SLACK).timestamp() * 1000)}"
    if not _newest_is_logged(mlflow_client, experiment_id, where, list(need.values())):
        return []
    token = None
    while True:
        page = _retry(
            mlflow_client.search_runs,
            [experiment_id],
            where,
            max_results=PAGE,
            order_by=["attributes.start_time DESC"],
            page_token=token,
        )
        for run in page:
            if not all(_may_hold(run, r, hashes.get(r.get("candidate"))) for r in need.values()):
                continue
            theirs = {tuple(r.get(k) for k in keys): r for r in run_rows(tracking_uri, run, what="MLflow logging")}
            if all(
                k in theirs
                and _may_hold(run, r, hashes.get(r.get("candidate")))
                and _canonical(theirs[k]) == _canonical(r)
                for k, r in need.items()
            ):
                return [{"run_id": run.info.run_id, "run_name": run.info.run_name, "rows": len(need)}]
        token = page.token
        if not token:
            return []
