"""The kb-nano view of an experiment's runs table in the MLflow UI: which columns it shows.

MLflow 3.17's runs table shows the Source, Models and Dataset columns until the user picks
others. It also keeps saved views ("Views" above the table) as experiment tags
``mlflow.sharedViewState.<id>`` holding ``{name, createdAt, updatedAt, state}``, where
``state`` is the JSON of the table's settings (``selectedColumns``: column ids such as
``metrics.`pass_rate```), and opens one from the runs page's URL
``?viewStateShareKey=<id>``. Every kb-nano experiment carries such a view, id
:data:`VIEW_ID`, showing the run's summary metrics and what it selected;
``kb_nano mlflow-ui`` prints its URL.
"""

from __future__ import annotations

import json
import time

from kb_nano.tracking.store import _retry

VIEW_ID = "kb_nano"
VIEW_NAME = "kb-nano summary"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_ID}"
VIEW_QUERY = f"viewStateShareKey={VIEW_ID}"
# Tier -> (summary metrics, params) the view shows, in this order.
_COMMON_METRICS = ("geomean_speedup", "pass_rate", "scenarios_run")
VIEW_COLUMNS = {
    "kernels": (
        (*_COMMON_METRICS, "passed", "failed", "significant", "review"),
        ("targets", "models", "tp", "num_tokens", "device_name", "git_sha"),
    ),
    "e2e": ((*_COMMON_METRICS, "ok", "failed"), ("models", "tp", "workloads", "variants", "device_name", "git_sha")),
    "eval": ((*_COMMON_METRICS, "ok", "failed"), ("models", "tp", "workloads", "variants", "device_name", "git_sha")),
}


def view_state(tier: str) -> dict:
    """The runs table's settings the view applies: the :data:`VIEW_COLUMNS` of ``tier``
    as the UI's column ids (the UI shows the metrics group, then the params group, each
    sorted by name)."""
    metrics, params = VIEW_COLUMNS[tier]
    columns = [f"params.`{p}`" for p in params] + [f"metrics.`{m}`" for m in metrics]
    return {"selectedColumns": columns}


def ensure_view(mlflow_client, experiment, tier: str) -> None:
    """Give ``experiment`` (an ``mlflow.entities.Experiment`` of ``tier``) the kb-nano
    view (:data:`VIEW_TAG`), or bring an existing one up to date with
    :func:`view_state`; nothing is written when it already matches. Other views are left
    alone."""
    state = view_state(tier)
    current = experiment.tags.get(VIEW_TAG)
    created = int(time.time() * 1000)
    if current:
        try:
            envelope = json.loads(current)
            if envelope.get("name") == VIEW_NAME and json.loads(envelope["state"]) == state:
                return
            created = int(envelope.get("createdAt", created))
        except (ValueError, TypeError, KeyError, AttributeError):
            pass
    envelope = {"name": VIEW_NAME, "createdAt": created, "updatedAt": int(time.time() * 1000)}
    value = json.dumps(envelope | {"state": json.dumps(state)})
    _retry(mlflow_client.set_experiment_tag, experiment.experiment_id, VIEW_TAG, value)
