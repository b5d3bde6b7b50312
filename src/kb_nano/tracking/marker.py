"""The marker of a tier's log rule (``results/mlflow/<tier>.json``,
:func:`kb_nano.tracking.store.marker_path`) read back: whether the rule ran, and which
MLflow run it recorded, said in one line after a command. Cheap to import (no mlflow)."""

from __future__ import annotations

import json
from pathlib import Path

from kb_nano.tracking.store import RUN_NAME_CHARS


def read_marker(root: Path, marker: str) -> dict | None:
    """The record the tier's log rule wrote at ``marker`` (relative to ``root``:
    :func:`kb_nano.tracking.marker_path`), or None when there is none (or it is not a JSON
    record). Read before and after Snakemake runs, it says whether the rule ran: each
    run writes a new ``logged_at`` (:func:`kb_nano.tracking.runs.log_run`)."""
    try:
        rec = json.loads((root / marker).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def print_mlflow_record(root: Path, marker: str, marker_before: dict | None) -> None:
    """Say which MLflow run the tier's log rule recorded (new, existing, or unchanged), by
    the first 12 characters of its id: the run's name in the MLflow UI, the run column of
    ``kb_nano history`` and what ``history --compare`` takes. ``marker_before`` is the
    marker's record before Snakemake ran (:func:`read_marker`): the same record now means
    the rule did not run ("nothing changed since run"). A result set logged as no run
    because an earlier run holds all its rows (the record's ``recorded_in``) names it.
    After a new run, a line gives the ``history --compare`` of the previous run and it,
    when the two share a row (both records' ``row_keys``: only Tier 1 records them, and
    ``history --compare`` compares Tier 1 runs only)."""
    rec = read_marker(root, marker)
    if rec is None:
        return
    run = rec["run_id"][:RUN_NAME_CHARS]
    holders = rec.get("recorded_in") or []
    if holders:  # (one run holds every row: kb_nano.tracking.recorded.recorded_in)
        print(
            f"MLflow: no new run, nothing new was measured: all {holders[0]['rows']} rows are already recorded in "
            f"run {holders[0]['run_id'][:RUN_NAME_CHARS]} in {rec['experiment']} ({rec['tracking_uri']}); "
            "see `kb_nano history`"
        )
        return
    if rec == marker_before:
        how = "nothing changed since run"
    else:
        how = "new run" if rec["created"] else "inputs unchanged, existing run"
    print(f"MLflow: {how} {run} in {rec['experiment']} ({rec['tracking_uri']}); see `kb_nano history`")
    before = (marker_before or {}).get("run_id")
    shared = (
        "row_keys" in rec
        and "row_keys" in (marker_before or {})
        and not set(rec["row_keys"]).isdisjoint(marker_before["row_keys"])
    )
    if (
        rec["created"]
        and before
        and before != rec["run_id"]
        and rec["experiment"] == marker_before.get("experiment")
        and shared
    ):
        print(f"what changed since the previous run: kb_nano history --compare {before[:RUN_NAME_CHARS]} {run}")
