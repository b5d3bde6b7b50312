"""MLflow tracking: the single writer of a tier's merged results (docs/architecture.md, "Tracking").

One experiment per tier (``kb_nano/kernels``, ``kb_nano/e2e``, ``kb_nano/eval``), one run
per merged result set. A run is keyed by a digest of its inputs (:func:`result_digest`:
the merged rows, the manifest, the candidate source hashes); logging the same digest
again returns the existing run instead of creating a second one, so re-running the
rule on unchanged inputs adds nothing, while an edited candidate (new rows, new hash)
adds exactly one run.

Store: ``--tracking-uri``/``explicit`` > ``$MLFLOW_TRACKING_URI`` > config key
``mlflow_tracking_uri`` > the embedded default, an SQLite file ``results/mlflow.db``
(absolute ``sqlite:////...`` URI) with artifacts in ``results/mlflow-artifacts/``.
Writers to an SQLite store serialise on a lock file next to the database (two sweeps
finishing at once are both recorded) and retry on ``database is locked``; against a
server, a run that loses a race to an identical digest deletes itself.

Importing this module is cheap (no mlflow, no torch): the Snakefile calls
:func:`resolve_tracking_uri` at parse time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import kb_nano
from kb_nano.errors import KbNanoError
from kb_nano.provenance import git_sha, package_version

EXPERIMENT_PREFIX = "kb_nano"
TIERS = ("kernels", "e2e", "eval")
DEFAULT_DB = Path("results/mlflow.db")
ARTIFACTS_DIR_NAME = "mlflow-artifacts"
CONFIG_KEY = "mlflow_tracking_uri"
ENV_VAR = "MLFLOW_TRACKING_URI"
DIGEST_TAG = "kb_nano.digest"
TAG_PREFIX = "kb_nano."
CANDIDATE_TAG_PREFIX = "kb_nano.candidate."
# Tier -> artifact path (inside the run) of the merged JSON whose "rows" --compare reads.
ROWS_ARTIFACT = {"kernels": "results/kernels.json", "e2e": "results/e2e.json", "eval": "results/eval.json"}
MARKER = "results/mlflow/{tier}.json"  # output of the log rule of each tier
MAX_PARAM_CHARS = 6000  # MLflow's param value limit
MAX_TAG_CHARS = 8000  # MLflow's tag value limit


# ----------------------------------------------------------------------------- store URI


def experiment_name(tier: str) -> str:
    """``kb_nano/{tier}``; raises ``KbNanoError`` for a tier not in :data:`TIERS`."""
    if tier not in TIERS:
        raise KbNanoError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
    return f"{EXPERIMENT_PREFIX}/{tier}"


def marker_path(tier: str) -> str:
    """The log rule's output for ``tier`` (relative to the workflow root): a JSON record
    of the run (run_id, experiment, digest, tracking URI, created)."""
    experiment_name(tier)
    return MARKER.format(tier=tier)


def default_tracking_uri(root: Path) -> str:
    """The embedded store: ``sqlite:////<abs root>/results/mlflow.db``."""
    return "sqlite:///" + str((Path(root) / DEFAULT_DB).resolve())


def resolve_tracking_uri(root: Path, config: dict | None = None, explicit: str | None = None) -> str:
    """The tracking URI to use: ``explicit`` (a CLI flag), else ``$MLFLOW_TRACKING_URI``,
    else ``config['mlflow_tracking_uri']``, else :func:`default_tracking_uri`. Empty
    strings count as unset. A relative SQLite path (``sqlite:///results/x.db``) or a plain
    file path ending in ``.db`` is made absolute against ``root``.

    Raises ``KbNanoError`` for an in-memory SQLite URI (nothing would be recorded).
    Cheap: no mlflow import.
    """
    for value in (explicit, os.environ.get(ENV_VAR), (config or {}).get(CONFIG_KEY)):
        if value and str(value).strip():
            return _normalize(str(value).strip(), Path(root))
    return default_tracking_uri(root)


def _normalize(uri: str, root: Path) -> str:
    if uri.startswith("sqlite:"):
        if not uri.startswith("sqlite:///") or uri[len("sqlite:///") :] in ("", ":memory:"):
            raise KbNanoError(f"tracking URI {uri!r}: an in-memory SQLite store keeps nothing; use sqlite:////abs/path.db")
        path = Path(uri[len("sqlite:///") :])
        if not path.is_absolute():
            path = (root / path).resolve()
        return "sqlite:///" + str(path)
    if "://" not in uri and uri.endswith(".db"):
        return "sqlite:///" + str((root / uri).resolve())
    scheme = uri.split("://", 1)[0].split("+", 1)[0] if "://" in uri else ""
    if scheme not in ("http", "https", "file", "postgresql", "mysql", "mssql") and uri != "databricks":
        raise KbNanoError(
            f"tracking URI {uri!r}: not an MLflow store; use sqlite:////abs/path.db, http(s)://host:port, or a *.db path"
        )
    return uri


def sqlite_path(uri: str) -> Path | None:
    """The database file of an absolute ``sqlite:///`` URI, else None."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :])
    return None


def is_server(uri: str) -> bool:
    """True for an ``http(s)://`` tracking server."""
    return uri.startswith(("http://", "https://"))


def artifact_root(uri: str) -> Path | None:
    """Where a SQLite store keeps artifacts: ``<db dir>/mlflow-artifacts``; None for other
    stores (a server decides itself)."""
    db = sqlite_path(uri)
    return db.parent / ARTIFACTS_DIR_NAME if db else None


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """For a server URI, GET ``{uri}/health``; raises ``KbNanoError`` (one line) when it
    does not answer within ``timeout_s`` seconds. No-op for other stores."""
    if not is_server(uri):
        return
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            resp.read(64)
    except urllib.error.HTTPError as exc:
        if exc.code < 500:
            return  # it answers (e.g. a proxy without /health): good enough
        reason = f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = " ".join(str(getattr(exc, "reason", exc)).split())
    else:
        return
    raise KbNanoError(
        f"MLflow tracking server {uri} is unreachable ({reason}); start it, or unset "
        f"{ENV_VAR} / config {CONFIG_KEY} to use the embedded SQLite store"
    )


def client(uri: str):
    """An ``mlflow.MlflowClient`` on ``uri`` after :func:`check_reachable`; creates the
    parent directory of an SQLite database. Raises ``KbNanoError`` for an unreachable server."""
    check_reachable(uri)
    db = sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    _quiet_mlflow()
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _quiet_mlflow() -> None:
    import logging

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


@contextlib.contextmanager
def store_lock(uri: str, timeout_s: float = 600.0):
    """Exclusive lock for writers of an SQLite store (``<db>.lock``, ``fcntl.flock``,
    released when the block ends or the process dies); no-op for other stores.
    Raises ``KbNanoError`` if not acquired within ``timeout_s`` seconds."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    import fcntl

    db.parent.mkdir(parents=True, exist_ok=True)
    lock_path = db.with_name(db.name + ".lock")
    with open(lock_path, "a") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise KbNanoError(f"{lock_path}: another writer held the MLflow store lock for {timeout_s:.0f} s") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _retry(fn, *args, attempts: int = 8, **kwargs):
    """Call ``fn``; on SQLite ``database is locked`` (a reader such as the UI holding the
    file) retry with exponential backoff (0.25 s doubling, capped at 8 s)."""
    delay = 0.25
    for i in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # MlflowException wraps sqlalchemy's OperationalError
            if "database is locked" not in str(exc) or i == attempts - 1:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 8.0)


# ----------------------------------------------------------------------------- digest


def canonical_rows(rows: list[dict]) -> list[dict]:
    """Rows with NaN/inf floats as None, sorted by their canonical JSON (order-free)."""
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
    return sorted(clean, key=lambda r: json.dumps(r, sort_keys=True, default=str))


def result_digest(tier: str, rows: list[dict], manifest_sha256: str | None, candidate_hashes: dict[str, str]) -> str:
    """SHA-256 (hex) keying one run: tier + every field of every merged row (including
    ``created_at``/``wall_s``, which stay fixed unless a shard is re-measured) + the
    manifest's SHA-256 + ``{candidate id: source SHA-256}``. Row order does not matter."""
    payload = {
        "tier": tier,
        "rows": canonical_rows(rows),
        "manifest_sha256": manifest_sha256,
        "candidates": dict(sorted(candidate_hashes.items())),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """SHA-256 hex of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def candidate_hashes(rows: list[dict], root: Path) -> dict[str, str]:
    """``{candidate id: SHA-256 of candidates/{id}.py}`` for every candidate in ``rows``;
    falls back to the rows' ``candidate_sha256`` when the file is gone (None if neither)."""
    out: dict[str, str] = {}
    for cid in sorted({r["candidate"] for r in rows if r.get("candidate")}):
        path = Path(root) / "candidates" / f"{cid}.py"
        if path.is_file():
            out[cid] = file_sha256(path)
        else:
            shas = sorted({r["candidate_sha256"] for r in rows if r["candidate"] == cid and r.get("candidate_sha256")})
            out[cid] = ",".join(shas) or None
    return out


# ----------------------------------------------------------------------------- kernel summaries


def kernel_metrics(rows: list[dict]) -> dict[str, float]:
    """Metrics of a kernel result set (None values dropped):

    ``rows``, ``scenarios`` (distinct scenario ids), ``scenarios_run`` (candidate ×
    scenario rows not skipped), ``passed``, ``failed``, ``skipped``, ``status/<status>``
    counts, ``pass_rate`` (passed / run, 0..1), ``geomean_speedup`` (geometric mean of
    baseline_ms / candidate_ms over passed rows), and ``geomean_speedup/target/<t>``,
    ``pass_rate/target/<t>``, ``geomean_speedup/candidate/<id>``,
    ``pass_rate/candidate/<id>``, ``significant`` (passed rows whose speedup 95%
    interval excludes 1.0) and ``review`` (rows flagged as implausible).
    """
    from kb_nano.merge import geomean

    def block(rs):
        run = [r for r in rs if r["status"] != "skipped"]
        passed = [r for r in run if r["status"] == "passed"]
        return {
            "pass_rate": len(passed) / len(run) if run else None,
            "geomean_speedup": geomean(r.get("speedup") for r in passed),
        }

    run = [r for r in rows if r["status"] != "skipped"]
    passed = [r for r in run if r["status"] == "passed"]
    m: dict[str, float | None] = {
        "rows": len(rows),
        "scenarios": len({r["scenario_id"] for r in rows}),
        "scenarios_run": len(run),
        "passed": len(passed),
        "failed": len(run) - len(passed),
        "skipped": len(rows) - len(run),
        "significant": sum(bool(r.get("significant")) for r in passed),
        "review": sum(bool(r.get("review")) for r in rows),
        **block(rows),
    }
    for status in sorted({r["status"] for r in rows}):
        m[f"status/{status}"] = sum(r["status"] == status for r in rows)
    for field, prefix in (("target", "target"), ("candidate", "candidate")):
        for value in sorted({r[field] for r in rows}):
            b = block([r for r in rows if r[field] == value])
            m[f"geomean_speedup/{prefix}/{value}"] = b["geomean_speedup"]
            m[f"pass_rate/{prefix}/{value}"] = b["pass_rate"]
    return {k: float(v) for k, v in m.items() if v is not None and math.isfinite(float(v))}


def _distinct(rows: list[dict], field: str, sep: str = ",") -> str:
    values = sorted({str(r[field]) for r in rows if r.get(field) is not None}, key=_natural)
    return sep.join(values)


def _natural(text: str):
    return (0, int(text)) if text.isdigit() else (1, text)


def config_digest(config: dict | None) -> str:
    """SHA-256 of the canonical JSON of the workflow config, without the tracking-URI key
    (where results are recorded is not part of what was measured)."""
    clean = {k: v for k, v in (config or {}).items() if k != CONFIG_KEY}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()


def kernel_params(rows: list[dict], config: dict | None, root: Path) -> dict[str, str]:
    """Run params: config digest, models/TP/token counts seen in the rows, the measurement
    settings (warmup/runs/tolerances/device/dtype; from ``config`` when given, else from
    the rows), versions (kb_nano, torch, triton as measured; vLLM installed here), the git
    sha (the rows', else the checkout's now) and the device name(s)."""
    config = config or {}

    def setting(key):
        if key in config and config[key] is not None:
            return str(config[key])
        return _distinct(rows, key)

    return {
        "config_digest": config_digest(config),
        "models": _distinct(rows, "model"),
        "tp": _distinct(rows, "tp"),
        "num_tokens": _distinct(rows, "num_tokens"),
        "dtype": _distinct(rows, "dtype"),
        "targets": _distinct(rows, "target"),
        "device": _distinct(rows, "device") or setting("device"),
        "device_name": _distinct(rows, "device_name", "; ") or "none measured",
        "num_warmup": setting("num_warmup"),
        "num_runs": setting("num_runs"),
        "atol": setting("atol"),
        "rtol": setting("rtol"),
        "kb_nano_version": _distinct(rows, "kb_nano_version") or kb_nano.__version__,
        "torch_version": _distinct(rows, "torch_version") or package_version("torch") or "not installed",
        "triton_version": _distinct(rows, "triton_version") or package_version("triton") or "not installed",
        "vllm_version": package_version("vllm") or "not installed",
        "git_sha": _distinct(rows, "git_sha") or git_sha(root) or "unknown",
        "schema_version": _distinct(rows, "schema_version"),
    }


# ----------------------------------------------------------------------------- logging


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
    record = _log_run(tier=tier, tracking_uri=tracking_uri, digest=digest, params=params, metrics=metrics, tags=tags,
                      artifacts=artifacts, run_name=run_name, lock_timeout_s=lock_timeout_s)
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
        run = _retry(c.create_run, exp_id, tags={k: str(v)[:MAX_TAG_CHARS] for k, v in all_tags.items()}, run_name=run_name)
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


def read_parquet_rows(path: Path) -> list[dict]:
    """All rows of a merged Parquet file as dicts."""
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def log_kernels(
    *,
    parquet: Path,
    json_path: Path,
    manifest: Path,
    plots: list[Path],
    tracking_uri: str,
    root: Path,
    config: dict | None = None,
    marker: Path | None = None,
    manifest_digest: str | None = None,
) -> dict:
    """Log the merged kernel results (``results/kernels.parquet`` + JSON) as one run of
    ``kb_nano/kernels`` via :func:`log_run`, keyed by :func:`result_digest` of the rows,
    the manifest and the candidate hashes. Artifacts: ``results/`` (Parquet, JSON),
    ``plots/``, ``inputs/`` (manifest). Writes the record as JSON to ``marker`` (atomic)
    when given and returns it.

    ``manifest_digest``: the manifest's ``inputs_digest`` this run was planned with; a
    manifest file with another one was rewritten by a concurrent invocation (the Snakefile
    computes it while parsing, before Snakemake's lock), and logging it would attach the
    wrong provenance: raises ``KbNanoError`` instead."""
    from kb_nano.manifest import load as load_manifest

    if manifest_digest is not None and load_manifest(manifest).get("inputs_digest") != manifest_digest:
        raise KbNanoError(f"{manifest} was rewritten by another kb_nano/snakemake invocation while this one ran; "
                          "rerun this command to log its results (its rows are kept)")
    tier = "kernels"
    rows = read_parquet_rows(parquet)
    cands = candidate_hashes(rows, root)
    digest = result_digest(tier, rows, file_sha256(manifest), cands)
    targets = sorted({r["target"] for r in rows})
    models = sorted({r["model"] for r in rows})
    tags = {
        "kb_nano.candidates": ",".join(cands),
        "kb_nano.targets": ",".join(targets),
        "kb_nano.models": ",".join(models),
        "kb_nano.rows_artifact": f"results/{Path(json_path).name}",
        **{f"{CANDIDATE_TAG_PREFIX}{cid}": sha or "unknown" for cid, sha in cands.items()},
    }
    params = kernel_params(rows, config, root)
    record = log_run(
        tier=tier,
        tracking_uri=tracking_uri,
        digest=digest,
        params=params,
        metrics=kernel_metrics(rows),
        tags=tags,
        artifacts={"results": [Path(parquet), Path(json_path)], "plots": [Path(p) for p in plots], "inputs": [Path(manifest)]},
        run_name=f"{tier}-{digest[:12]}",
        marker=marker,
    )
    return record


# ----------------------------------------------------------------------------- e2e (Tier 2)


def e2e_candidate_hashes(rows: list[dict]) -> dict[str, str]:
    """``{candidate id: SHA-256}`` from the rows' ``candidate_sha256`` JSON (the hash the
    job measured)."""
    out: dict[str, str] = {}
    for r in rows:
        out.update(json.loads(r.get("candidate_sha256") or "{}"))
    return dict(sorted(out.items()))


def e2e_metrics(rows: list[dict]) -> dict[str, float]:
    """Metrics of an e2e result set (None values dropped): ``rows`` (= ``scenarios_run``),
    ``ok``, ``failed``, ``pass_rate`` (ok / rows), ``geomean_speedup`` (over the ok
    candidate-variant rows; what ``kb_nano history`` shows),
    ``status/<status>`` counts, and per ok row ``<metric>/<model>/tp<tp>/<workload>/<variant>``
    for ``total_tokens_per_s``, ``output_tokens_per_s``, ``requests_per_s`` (throughput),
    ``avg_latency_ms``, ``p50_latency_ms``, ``p99_latency_ms`` (latency) and ``speedup``,
    plus ``geomean_speedup/<variant>`` over the variant's ok rows (``+`` in a variant
    name is a space in metric names: MLflow does not allow ``+``)."""
    from kb_nano.merge import geomean

    ok = [r for r in rows if r["status"] == "ok"]
    m: dict[str, float | None] = {
        "rows": len(rows),
        "scenarios_run": len(rows),
        "ok": len(ok),
        "failed": len(rows) - len(ok),
        "pass_rate": len(ok) / len(rows) if rows else None,
        "geomean_speedup": geomean(r.get("speedup") for r in ok if r["variant"] != "baseline"),
    }
    for status in sorted({r["status"] for r in rows}):
        m[f"status/{status}"] = sum(r["status"] == status for r in rows)
    keys = ("total_tokens_per_s", "output_tokens_per_s", "requests_per_s", "avg_latency_ms", "p50_latency_ms",
            "p99_latency_ms", "speedup")
    for r in ok:
        where = f"{r['model']}/tp{r['tp']}/{r['workload']}/{r['variant']}"
        for k in keys:
            m[f"{k}/{where}"] = r.get(k)
    for v in sorted({r["variant"] for r in rows}):
        m[f"geomean_speedup/{v}"] = geomean(r.get("speedup") for r in ok if r["variant"] == v)
    return {_metric_key(k): float(v) for k, v in m.items() if v is not None and math.isfinite(float(v))}


def _metric_key(key: str) -> str:
    """MLflow metric names allow letters, digits, ``_ - . / space``; a variant's ``+``
    becomes `` `` (space), anything else disallowed becomes ``_``."""
    import re

    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", key.replace("+", " "))


def e2e_params(rows: list[dict], config: dict | None, root: Path) -> dict[str, str]:
    """Run params of an e2e result set: config digest, models/TP/workloads/variants, the
    engine settings, weights, versions (vLLM, torch as measured), git sha, device."""
    e2e = (config or {}).get("e2e") or {}
    return {
        "config_digest": config_digest(config),
        "models": _distinct(rows, "model"),
        "tp": _distinct(rows, "tp"),
        "workloads": _distinct(rows, "workload"),
        "variants": _distinct(rows, "variant"),
        "weights": _distinct(rows, "weights", "; "),
        "dtype": _distinct(rows, "dtype"),
        "max_model_len": _distinct(rows, "max_model_len"),
        "enforce_eager": _distinct(rows, "enforce_eager"),
        "seed": _distinct(rows, "seed"),
        "timeout_s": str(e2e.get("timeout_s", "")),
        "device": _distinct(rows, "device"),
        "device_name": _distinct(rows, "device_name", "; ") or "none measured",
        "vllm_version": _distinct(rows, "vllm_version") or "not installed",
        "torch_version": _distinct(rows, "torch_version") or package_version("torch") or "not installed",
        "kb_nano_version": _distinct(rows, "kb_nano_version") or kb_nano.__version__,
        "git_sha": _distinct(rows, "git_sha") or git_sha(root) or "unknown",
        "schema_version": _distinct(rows, "schema_version"),
    }


def log_e2e(
    *,
    parquet: Path,
    json_path: Path,
    tracking_uri: str,
    root: Path,
    config: dict | None = None,
    marker: Path | None = None,
    tier: str = "e2e",
) -> dict:
    """Log the merged e2e (or, with ``tier="eval"``, eval) results (``results/{tier}.parquet``
    + JSON) as one run of ``kb_nano/{tier}`` via :func:`log_run`, keyed by :func:`result_digest` of the rows and
    the candidate hashes (same digest -> no new run). Artifacts: ``results/`` (Parquet,
    JSON) and ``vllm/`` (each ok job's vLLM ``--output-json`` file). Writes the record to
    ``marker`` (atomic) when given and returns it."""

    rows = read_parquet_rows(parquet)
    cands = e2e_candidate_hashes(rows)
    digest = result_digest(tier, rows, None, cands)
    tags = {
        "kb_nano.candidates": ",".join(cands),
        "kb_nano.models": ",".join(sorted({r["model"] for r in rows})),
        "kb_nano.variants": ",".join(sorted({r["variant"] for r in rows})),
        "kb_nano.rows_artifact": f"results/{Path(json_path).name}",
        **{f"{CANDIDATE_TAG_PREFIX}{cid}": sha for cid, sha in cands.items()},
    }
    params = e2e_params(rows, config, root)
    if tier == "eval":
        ev = (config or {}).get("eval") or {}
        params.update({"smoke": str(bool(ev.get("smoke"))), "num_prompts": str(ev.get("num_prompts", "")),
                       "gpu_pool": str(ev.get("gpu_pool", ""))})
        tags["kb_nano.smoke"] = params["smoke"]
    vllm_files = sorted({Path(r["vllm_json"]) for r in rows if r["status"] == "ok" and r.get("vllm_json")})
    record = log_run(
        tier=tier,
        tracking_uri=tracking_uri,
        digest=digest,
        params=params,
        metrics=e2e_metrics(rows),
        tags=tags,
        artifacts={"results": [Path(parquet), Path(json_path)], **_vllm_artifacts(vllm_files, root)},
        run_name=f"{tier}-{digest[:12]}",
        marker=marker,
    )
    return record


def _vllm_artifacts(files: list[Path], root: Path) -> dict[str, list[Path]]:
    """vLLM JSON files grouped by artifact dir ``vllm/{model}/tp{tp}/{workload}`` (their
    path under ``results/e2e``), so variants of one workload sit together."""
    out: dict[str, list[Path]] = {}
    for f in files:
        full = f if f.is_absolute() else Path(root) / f
        if not full.is_file():
            continue
        try:
            rel = full.resolve().relative_to((Path(root) / "results/e2e").resolve()).parent
        except ValueError:
            rel = Path(".")
        out.setdefault(str(Path("vllm") / rel), []).append(full)
    return out
