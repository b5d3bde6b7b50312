"""The MLflow store: its URI (flag > ``$MLFLOW_TRACKING_URI`` > config > ``results/mlflow.db``),
the client, the writers' lock and the retry on a locked SQLite file (no mlflow or torch
at import: the Snakefile resolves the URI at parse time)."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from kb_nano.errors import KbNanoError

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
MAX_METRIC_NAME_CHARS = 250  # MLflow's metric key limit
RUN_NAME_CHARS = 12  # a run is named by this prefix of its id: what `kb_nano history` shows
# MLflow 3 UIs that read this experiment tag show the runs table, not the GenAI (traces) layout
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"  # a run's table artifacts (MlflowClient.log_table)
# MLflow 3.17's UI picks its layout from this query parameter, else from what the browser
# stored when the user last used the sidebar's GenAI / Model training switch (default: GenAI)
UI_WORKFLOW_QUERY = "workflowType=machine_learning"
ROW_METRIC = "speedup"  # the one per-row metric of a kernel run (row_metric_name)
_METRIC_ILLEGAL = re.compile(r"[^A-Za-z0-9_\-. ]")


def four_digits(value):
    """``value`` as MLflow shows it: a finite float that is not a whole number rounded to
    4 significant digits (``1.0431234`` -> ``1.043``, ``0.0123456`` -> ``0.01235``); whole
    numbers (counts), non-floats and non-finite values unchanged. Full precision stays in
    the run's ``results/`` files."""
    if isinstance(value, float) and math.isfinite(value) and not value.is_integer():
        return float(f"{value:.4g}")
    return value


def experiment_name(tier: str) -> str:
    """``kb_nano/{tier}``; raises ``KbNanoError`` for a tier not in :data:`TIERS`."""
    if tier not in TIERS:
        raise KbNanoError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
    return f"{EXPERIMENT_PREFIX}/{tier}"


def metric_name(*parts: str) -> str:
    """A stable, MLflow-legal metric name ``part/part/...``: ``/`` inside a part separates
    path segments too (``speedup``, ``rms_norm__llama31-8b__tp1__n64``, ``rms_norm/torch_fused``
    -> ``speedup/rms_norm__llama31-8b__tp1__n64/rms_norm/torch_fused``).

    MLflow takes letters, digits, ``_ - . / space`` (and ``:`` except on Windows) and a
    path that normalises to itself (no empty, ``.`` or ``..`` segment), at most 250
    characters. Other characters (``:`` too) become ``_``, an empty/``.``/``..`` segment
    becomes ``_``; a name that had to change or be shortened ends in ``-`` and 8 hex
    digits of the SHA-256 of the raw name, so distinct names stay distinct."""
    raw = "/".join(str(p) for p in parts)
    segments = [_METRIC_ILLEGAL.sub("_", seg) for seg in raw.split("/")]
    name = "/".join("_" if seg in ("", ".", "..") else seg for seg in segments)
    if name != raw or len(name) > MAX_METRIC_NAME_CHARS:
        tag = hashlib.sha256(raw.encode()).hexdigest()[:8]
        name = name[: MAX_METRIC_NAME_CHARS - len(tag) - 1] + "-" + tag
    return name


def row_metric_name(row: dict) -> str:
    """The per-row metric of a passed kernel row: its speedup, named
    ``speedup/<target>/<scenario> <candidate>`` where scenario and candidate are the ids
    without their ``<target>__`` and ``<target>/`` prefixes (:func:`metric_name` makes the
    name legal), e.g. ``speedup/rms_norm/llama31-8b__tp1__n64 torch_fused``. The same row
    has the same name in every run; the MLflow UI groups a run's charts by what precedes
    the last ``/``, so one section per target holds a chart per scenario and candidate."""
    target = str(row["target"])
    scenario = str(row["scenario_id"]).removeprefix(f"{target}__")
    candidate = str(row["candidate"]).removeprefix(f"{target}/")
    return metric_name(ROW_METRIC, target, f"{scenario} {candidate}")


def marker_path(tier: str) -> str:
    """The log rule's output for ``tier`` (relative to the workflow root): a JSON record
    of the run (run_id, experiment, digest, tracking URI, created, logged_at)."""
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


def command_tracking_uri(configfile: str | None, explicit: str | None) -> str:
    """The store a ``kb_nano`` command reads (``history``, ``mlflow-ui``):
    :func:`resolve_tracking_uri` of the workflow (:func:`kb_nano.paths.find_workflow_root`)
    with its effective config (``configfile`` over ``config/config.yaml``:
    :func:`kb_nano.config.load`) and ``explicit`` (``--tracking-uri``)."""
    from kb_nano.config import load
    from kb_nano.paths import find_workflow_root

    root = find_workflow_root()
    return resolve_tracking_uri(root, load(root, configfile), explicit=explicit)


def _normalize(uri: str, root: Path) -> str:
    if uri.startswith("sqlite:"):
        if not uri.startswith("sqlite:///") or uri[len("sqlite:///") :] in ("", ":memory:"):
            raise KbNanoError(
                f"tracking URI {uri!r}: an in-memory SQLite store keeps nothing; use sqlite:////abs/path.db"
            )
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
                    raise KbNanoError(
                        f"{lock_path}: another writer held the MLflow store lock for {timeout_s:.0f} s"
                    ) from None
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
