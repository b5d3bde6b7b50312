"""One MLflow run per merged result set, found again by its digest (idempotent logging)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from kb_nano.tracking.store import (
    DIGEST_TAG,
    MAX_PARAM_CHARS,
    MAX_TAG_CHARS,
    _retry,
    artifact_root,
    client,
    experiment_name,
    store_lock,
)


def ensure_experiment(mlflow_client, tier: str, uri: str) -> str:
    """Id of experiment ``kb_nano/{tier}``, creating it (artifacts under the SQLite
    store's ``mlflow-artifacts/{tier}`` as an absolute ``file://`` URI) or restoring it if
    deleted. Safe against a concurrent creator."""
    from mlflow.exceptions import MlflowException

    name = experiment_name(tier)
    exp = _retry(mlflow_client.get_experiment_by_name, name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            _retry(mlflow_client.restore_experiment, exp.experiment_id)
        return exp.experiment_id
    root = artifact_root(uri)
    location = (root / tier).resolve().as_uri() if root else None
    try:
        return _retry(mlflow_client.create_experiment, name, artifact_location=location, tags={"kb_nano.tier": tier})
    except MlflowException:
        exp = mlflow_client.get_experiment_by_name(name)  # a concurrent writer created it
        if exp is None:
            raise
        return exp.experiment_id


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
    run_name: str | None = None,
    lock_timeout_s: float = 600.0,
    marker: Path | None = None,
) -> dict:
    """Record one result set as an MLflow run, idempotently.

    A ``params["git_sha"]`` other than ``unknown`` also becomes the
    ``mlflow.source.git.commit`` tag; with ``marker`` the returned record is written
    there as JSON (atomic; the log rule's output).

    If a FINISHED run tagged ``kb_nano.digest = digest`` exists in ``kb_nano/{tier}`` it
    is returned (``created: False``) and nothing is written. Otherwise a run is created
    with ``params`` (values truncated to 6000 chars), ``metrics`` (step 0), ``tags`` (plus
    tier and digest) and ``artifacts`` (``{artifact dir: [local files]}``), then set
    FINISHED (FAILED if logging raises). SQLite writers hold :func:`store_lock`; against a
    server a concurrent duplicate is resolved by keeping the oldest run.

    Returns ``{tier, experiment, experiment_id, run_id, run_name, digest, tracking_uri,
    artifact_uri, created}``. Raises ``KbNanoError`` for an unreachable server.
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
        run_name=run_name,
        lock_timeout_s=lock_timeout_s,
    )
    if marker is not None:
        atomic_write_text(Path(marker), json.dumps(record, indent=1, sort_keys=True) + "\n")
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
    run_name: str | None = None,
    lock_timeout_s: float = 600.0,
) -> dict:
    """The MLflow part of :func:`log_run`.

    If a FINISHED run tagged ``kb_nano.digest = digest`` exists in ``kb_nano/{tier}`` it
    is returned (``created: False``) and nothing is written. Otherwise a run is created
    with ``params`` (values truncated to 6000 chars), ``metrics`` (step 0), ``tags`` (plus
    tier and digest) and ``artifacts`` (``{artifact dir: [local files]}``), then set
    FINISHED (FAILED if logging raises). SQLite writers hold :func:`store_lock`; against a
    server a concurrent duplicate is resolved by keeping the oldest run.

    Returns ``{tier, experiment, experiment_id, run_id, run_name, digest, tracking_uri,
    artifact_uri, created}``. Raises ``KbNanoError`` for an unreachable server.
    """
    from mlflow.entities import Metric, Param

    exp_name = experiment_name(tier)
    with store_lock(tracking_uri, lock_timeout_s):
        c = client(tracking_uri)
        exp_id = ensure_experiment(c, tier, tracking_uri)
        existing = find_runs_by_digest(c, exp_id, digest)
        if existing:
            return _record(existing[0], tier, exp_name, exp_id, digest, tracking_uri, created=False)
        all_tags = {**tags, "kb_nano.tier": tier, DIGEST_TAG: digest}
        run = _retry(
            c.create_run, exp_id, tags={k: str(v)[:MAX_TAG_CHARS] for k, v in all_tags.items()}, run_name=run_name
        )
        run_id = run.info.run_id
        try:
            now = int(time.time() * 1000)
            plist = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in sorted(params.items())]
            mlist = [Metric(k, float(v), now, 0) for k, v in sorted(metrics.items())]
            for i in range(0, len(plist), 100):
                _retry(c.log_batch, run_id, params=plist[i : i + 100])
            for i in range(0, len(mlist), 1000):
                _retry(c.log_batch, run_id, metrics=mlist[i : i + 1000])
            for art_dir, paths in artifacts.items():
                for p in paths:
                    _retry(c.log_artifact, run_id, str(p), artifact_path=art_dir or None)
            _retry(c.set_terminated, run_id, "FINISHED")
        except BaseException:
            with contextlib.suppress(Exception):
                c.set_terminated(run_id, "FAILED")
            raise
        winners = find_runs_by_digest(c, exp_id, digest)
        if winners and winners[0].info.run_id != run_id:
            _retry(c.delete_run, run_id)  # lost a race against an identical result set
            return _record(winners[0], tier, exp_name, exp_id, digest, tracking_uri, created=False)
        return _record(c.get_run(run_id), tier, exp_name, exp_id, digest, tracking_uri, created=True)


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
