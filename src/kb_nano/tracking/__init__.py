"""MLflow tracking: the single writer of a tier's merged results (docs/architecture.md, "Tracking").

Modules: :mod:`~kb_nano.tracking.store` (the store's URI, client, lock), :mod:`~kb_nano.tracking.digest`
(what keys a run), :mod:`~kb_nano.tracking.runs` (one run per digest),
:mod:`~kb_nano.tracking.recorded` (which runs already hold a result set's rows),
:mod:`~kb_nano.tracking.selection` (what a logged run selected), :mod:`~kb_nano.tracking.kernels`
and :mod:`~kb_nano.tracking.e2e` (each tier's params, metrics and log call); the names
other modules use are imported here. The readers :mod:`~kb_nano.tracking.history`
(``kb_nano history``), :mod:`~kb_nano.tracking.plots`, :mod:`~kb_nano.tracking.speedup_plots` and
:mod:`~kb_nano.tracking.perf_plots` (the kernel plots),
:mod:`~kb_nano.tracking.report_table` (the HTML table) and :mod:`~kb_nano.tracking.ui`
(``kb_nano mlflow-ui``'s server) are not imported here: import them by their own path.

One experiment per tier (``kb_nano/kernels``, ``kb_nano/e2e``, ``kb_nano/eval``), one run
per merged result set. A run is keyed by a digest of its inputs (:func:`result_digest`:
the merged rows, the manifest, the candidate source hashes); logging the same digest
again returns the existing run instead of creating a second one, so re-running the
rule on unchanged inputs adds nothing, while an edited candidate (new rows, new hash)
adds exactly one run. A kernel result set whose every row earlier runs already hold
(a filtered rerun that reused every shard) adds no run either.

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

from kb_nano.tracking.digest import (  # noqa: F401
    candidate_hashes,
    canonical_rows,
    e2e_candidate_hashes,
    file_sha256,
    result_digest,
)
from kb_nano.tracking.e2e import (  # noqa: F401
    e2e_metrics,
    e2e_params,
    log_e2e,
)
from kb_nano.tracking.kernels import (  # noqa: F401
    config_digest,
    kernel_metrics,
    kernel_params,
    log_kernels,
    read_parquet_rows,
    scenario_metrics,
    table_rows,
)
from kb_nano.tracking.runs import (  # noqa: F401
    ensure_experiment,
    find_runs_by_digest,
    log_run,
)
from kb_nano.tracking.store import (  # noqa: F401
    ARTIFACTS_DIR_NAME,
    CANDIDATE_TAG_PREFIX,
    CONFIG_KEY,
    DEFAULT_DB,
    DIGEST_TAG,
    ENV_VAR,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    EXPERIMENT_PREFIX,
    LOGGED_ARTIFACTS_TAG,
    MARKER,
    MAX_PARAM_CHARS,
    MAX_TAG_CHARS,
    ROWS_ARTIFACT,
    RUN_NAME_CHARS,
    TAG_PREFIX,
    TIERS,
    UI_WORKFLOW_QUERY,
    artifact_root,
    check_reachable,
    client,
    default_tracking_uri,
    experiment_name,
    is_server,
    marker_path,
    metric_name,
    resolve_tracking_uri,
    sqlite_path,
    store_lock,
)
