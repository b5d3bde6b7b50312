"""One MLflow run per merged result set, found again by its digest (idempotent logging)."""

from __future__ import annotations

import contextlib
import json
import posixpath
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from kb_nano.tracking.store import (
    DIGEST_TAG,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    LOGGED_ARTIFACTS_TAG,
    MAX_PARAM_CHARS,
    MAX_TAG_CHARS,
    RUN_NAME_CHARS,
    _retry,
    artifact_root,
    client,
    experiment_name,
    four_digits,
    store_lock,
)
from kb_nano.tracking.ui_view import ensure_view


def ensure_experiment(mlflow_client, tier: str, uri: str) -> str:
    """Id of experiment ``kb_nano/{tier}``, creating it (artifacts under the SQLite
    store's ``mlflow-artifacts/{tier}`` as an absolute ``file://`` URI) or restoring it if
    deleted. Safe against a concurrent creator. The experiment carries
    ``mlflow.experimentKind = custom_model_development`` (set on an existing one that
    lacks it; the run-based kind, for MLflow UIs that choose their layout by it) and the
    kb-nano view of its runs table (:func:`kb_nano.tracking.ui_view.ensure_view`)."""
    from mlflow.exceptions import MlflowException

    name = experiment_name(tier)
    exp = _retry(mlflow_client.get_experiment_by_name, name)
    if exp is None:
        root = artifact_root(uri)
        location = (root / tier).resolve().as_uri() if root else None
        tags = {"kb_nano.tier": tier, EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        try:
            _retry(mlflow_client.create_experiment, name, artifact_location=location, tags=tags)
        except MlflowException:
            if _retry(mlflow_client.get_experiment_by_name, name) is None:
                raise  # not a concurrent writer that created it first
        exp = _retry(mlflow_client.get_experiment_by_name, name)
    if exp.lifecycle_stage == "deleted":
        _retry(mlflow_client.restore_experiment, exp.experiment_id)
    if EXPERIMENT_KIND_TAG not in exp.tags:
        _retry(mlflow_client.set_experiment_tag, exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    ensure_view(mlflow_client, exp, tier)
    return exp.experiment_id


def _ms(text) -> int | None:
    try:
        when = datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return int(when.timestamp() * 1000) if when.tzinfo else None


def row_span_ms(row: dict) -> tuple[int, int] | None:
    """When a row was measured, as ``(start, end)`` in ms since the epoch: its
    ``started_at`` .. ``ended_at`` (Tier 1), else ``created_at`` less ``wall_s`` ..
    ``created_at`` (Tiers 2 and 3, where the shard is written at the job's end); None
    when the row has no timezone-aware timestamp."""
    start, end = _ms(row.get("started_at")), _ms(row.get("ended_at"))
    if start is not None and end is not None:
        return start, end
    end = _ms(row.get("created_at"))
    if end is None:
        return None
    wall = row.get("wall_s")
    return end - int(1000 * wall) if isinstance(wall, int | float) and wall >= 0 else end, end


def run_times(mlflow_client, experiment_id: str, spans: list) -> tuple[int | None, int | None]:
    """A new run's ``(start_time, end_time)`` in ms from its rows' measurement spans
    (:func:`row_span_ms`; None entries ignored): the rows that ended after the
    experiment's newest FINISHED run ended (those this invocation measured; rows reused
    from earlier runs do not stretch the run back to when they were measured) give the
    first start and the last end. ``(None, None)``, i.e. MLflow's clock at logging, when
    no row is newer (a combination of earlier measurements: the run is then still the
    newest by start time) or there are no spans.
    """
    spans = [s for s in spans if s is not None]
    if not spans:
        return None, None
    newest = _retry(
        mlflow_client.search_runs,
        [experiment_id],
        "attributes.status = 'FINISHED'",
        max_results=1,
        order_by=["attributes.end_time DESC"],
    )
    after = newest[0].info.end_time if newest and newest[0].info.end_time else None
    fresh = [s for s in spans if after is None or s[1] > after]
    if not fresh:
        return None, None
    return min(start for start, _ in fresh), max(end for _, end in fresh)


def find_runs_by_digest(mlflow_client, experiment_id: str, digest: str) -> list:
    """FINISHED, active runs of the experiment tagged with ``digest``, oldest first
    (ties broken by run id, so every process picks the same one)."""
    runs = _retry(
        mlflow_client.search_runs,
        [experiment_id],
        f"tags.`{DIGEST_TAG}` = '{digest}' and attributes.status = 'FINISHED'",
        max_results=100,
    )
    return sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))


def log_run(
    *,
    tier: str,
    tracking_uri: str,
    digest: str,
    params: dict[str, str],
    metrics: dict[str, float],
    tags: dict[str, str],
    artifacts: dict[str, list[Path]],
    tables: dict[str, list[dict]] | None = None,
    lock_timeout_s: float = 600.0,
    marker: Path | None = None,
    recorded: Callable | None = None,
    row_keys: list[str] | None = None,
    spans: list | None = None,
) -> dict:
    """Record one result set as an MLflow run, idempotently.

    The run's start and end times are those of the measurement (``spans``: each row's
    :func:`row_span_ms`; see :func:`run_times`), so the UI's Duration is how long the
    measuring took, not how long logging took. Metric values are rounded by
    :func:`~kb_nano.tracking.store.four_digits` (4 significant digits; counts exact): the
    UI's runs table and charts show them as logged.

    A ``params["git_sha"]`` other than ``unknown`` also becomes the
    ``mlflow.source.git.commit`` tag; with ``marker`` the returned record is written
    there as JSON (atomic; the log rule's output) with ``logged_at``, the UTC time of this
    call (ISO 8601, microseconds): each run of the rule writes a record of its own, so a
    reader that kept the marker's record tells whether the rule ran since
    (:func:`kb_nano.tracking.marker.print_mlflow_record`), and ``row_keys`` when given (the
    rows' keys, which tell whether two records share rows).

    If a FINISHED run tagged ``kb_nano.digest = digest`` exists in ``kb_nano/{tier}`` it
    is returned (``created: False``) and nothing is written. Else, with ``recorded``
    (called as ``recorded(client, experiment_id)`` under the store lock, returning the
    ``[{run_id, run_name, rows}]`` of the runs that already hold every row, or ``[]``:
    :func:`kb_nano.tracking.recorded.recorded_in`), a non-empty answer creates nothing
    either: the record names the first of those runs (``created: False``) and lists
    them all under ``recorded_in``. Otherwise a run is created,
    named by the first 12 characters of its id (what ``kb_nano history`` and the CLI
    show), with ``params`` (values truncated to 6000 chars), ``metrics`` (step 0, 1000 per
    ``log_batch`` call, rounded), ``tags`` (plus tier and digest), ``artifacts`` (``{artifact dir:
    [local files]}``) and ``tables`` (``{artifact file (.json): rows}``, written as
    ``MlflowClient.log_table`` does, so the UI shows them as tables), then set FINISHED (FAILED
    if logging raises). SQLite writers hold :func:`store_lock`; against a server a
    concurrent duplicate is resolved by keeping the oldest run.

    Returns ``{tier, experiment, experiment_id, run_id, run_name, digest, tracking_uri,
    artifact_uri, created}`` (and ``recorded_in``, see above). Raises ``KbNanoError`` for
    an unreachable server.
    """
    from kb_nano.files import atomic_write_text

    if params.get("git_sha", "unknown") != "unknown":
        tags = {**tags, "mlflow.source.git.commit": params["git_sha"].split(",")[0].removesuffix("-dirty")}
    record = _log_run(
        tier=tier,
        tracking_uri=tracking_uri,
        digest=digest,
        params=params,
        metrics=metrics,
        tags=tags,
        artifacts=artifacts,
        tables=tables,
        lock_timeout_s=lock_timeout_s,
        recorded=recorded,
        spans=spans,
    )
    if marker is not None:
        logged_at = datetime.now(UTC).isoformat(timespec="microseconds")
        extra = {"logged_at": logged_at, **({"row_keys": sorted(row_keys)} if row_keys is not None else {})}
        atomic_write_text(Path(marker), json.dumps({**record, **extra}, indent=1, sort_keys=True) + "\n")
    return record


def _log_run(
    *,
    tier: str,
    tracking_uri: str,
    digest: str,
    params: dict[str, str],
    metrics: dict[str, float],
    tags: dict[str, str],
    artifacts: dict[str, list[Path]],
    tables: dict[str, list[dict]] | None = None,
    lock_timeout_s: float = 600.0,
    recorded: Callable | None = None,
    spans: list | None = None,
) -> dict:
    """The MLflow part of :func:`log_run` (what it creates, and when it creates nothing:
    see there).

    Returns ``{tier, experiment, experiment_id, run_id, run_name, digest, tracking_uri,
    artifact_uri, created}`` (and ``recorded_in``). Raises ``KbNanoError`` for an
    unreachable server.
    """
    from mlflow.entities import Metric, Param

    exp_name = experiment_name(tier)
    with store_lock(tracking_uri, lock_timeout_s):
        c = client(tracking_uri)
        exp_id = ensure_experiment(c, tier, tracking_uri)
        existing = find_runs_by_digest(c, exp_id, digest)
        if existing:
            return _record(existing[0], tier, exp_name, exp_id, digest, tracking_uri, created=False)
        holders = recorded(c, exp_id) if recorded is not None else []
        if holders:  # nothing new measured: the rows are already in these runs
            first = _retry(c.get_run, holders[0]["run_id"])
            return _record(first, tier, exp_name, exp_id, digest, tracking_uri, created=False) | {
                "recorded_in": holders
            }
        all_tags = {**tags, "kb_nano.tier": tier, DIGEST_TAG: digest}
        if tables:  # what MlflowClient.log_table records: the UI renders these files as tables
            all_tags[LOGGED_ARTIFACTS_TAG] = json.dumps([{"path": f, "type": "table"} for f in tables])
        start, end = run_times(c, exp_id, spans or [])
        run = _retry(
            c.create_run, exp_id, start_time=start, tags={k: str(v)[:MAX_TAG_CHARS] for k, v in all_tags.items()}
        )
        run_id = run.info.run_id
        try:
            _retry(c.update_run, run_id, name=run_id[:RUN_NAME_CHARS])
            now = end or int(time.time() * 1000)
            plist = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in sorted(params.items())]
            mlist = [Metric(k, four_digits(float(v)), now, 0) for k, v in sorted(metrics.items())]
            for i in range(0, len(plist), 100):
                _retry(c.log_batch, run_id, params=plist[i : i + 100])
            for i in range(0, len(mlist), 1000):
                _retry(c.log_batch, run_id, metrics=mlist[i : i + 1000])
            for art_dir, paths in artifacts.items():
                for p in paths:
                    _retry(c.log_artifact, run_id, str(p), artifact_path=art_dir or None)
            _log_tables(c, run_id, tables or {})
            _retry(c.set_terminated, run_id, "FINISHED", end_time=end)
        except BaseException:
            with contextlib.suppress(Exception):
                c.set_terminated(run_id, "FAILED")
            raise
        winners = find_runs_by_digest(c, exp_id, digest)
        if winners and winners[0].info.run_id != run_id:
            _retry(c.delete_run, run_id)  # lost a race against an identical result set
            return _record(winners[0], tier, exp_name, exp_id, digest, tracking_uri, created=False)
        return _record(c.get_run(run_id), tier, exp_name, exp_id, digest, tracking_uri, created=True)


def _log_tables(mlflow_client, run_id: str, tables: dict[str, list[dict]]) -> None:
    """Each ``{artifact file: rows}`` as the JSON ``MlflowClient.log_table`` writes (pandas
    ``split`` layout, read back by ``MlflowClient.load_table``); the run's
    ``mlflow.loggedArtifacts`` tag, set at creation, lists them. Unlike ``log_table``
    (which appends to an existing file) a retried upload leaves one copy."""
    import pandas as pd

    with tempfile.TemporaryDirectory(prefix="kb_nano_table_") as tmp:
        for artifact_file, rows in tables.items():
            local = Path(tmp) / posixpath.basename(artifact_file)
            pd.DataFrame.from_records(rows).to_json(local, orient="split", index=False, date_format="iso")
            _retry(
                mlflow_client.log_artifact, run_id, str(local), artifact_path=posixpath.dirname(artifact_file) or None
            )


def _record(run, tier, exp_name, exp_id, digest, uri, created: bool) -> dict:
    return {
        "tier": tier,
        "experiment": exp_name,
        "experiment_id": exp_id,
        "run_id": run.info.run_id,
        "run_name": run.info.run_name,
        "digest": digest,
        "tracking_uri": uri,
        "artifact_uri": run.info.artifact_uri,
        "created": created,
    }
