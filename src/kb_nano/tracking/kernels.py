"""Tier 1 in MLflow: a kernel sweep's params, summary metrics and the run that logs them."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import kb_nano
from kb_nano.errors import KbNanoError
from kb_nano.provenance import git_sha, package_version
from kb_nano.tracking.digest import candidate_hashes, file_sha256, result_digest
from kb_nano.tracking.recorded import recorded_in
from kb_nano.tracking.runs import log_run, row_span_ms
from kb_nano.tracking.selection import row_variant
from kb_nano.tracking.store import CANDIDATE_TAG_PREFIX, CONFIG_KEY, four_digits, row_metric_name

# The columns of the run's table artifact (TABLE_ARTIFACT), in this order: what answers
# "is it correct, how much faster" first (the MLflow UI shows the leftmost columns).
TABLE_COLUMNS = (
    "scenario_id",
    "candidate",
    "status",
    "speedup",
    "speedup_ci_low",
    "speedup_ci_high",
    "significant",
    "baseline_ms",
    "candidate_ms",
    "max_abs_err",
    "review",
    "error",
    "target",
    "model",
    "tp",
    "num_tokens",
    "speedup_basis",
    "device_name",
)
TABLE_ARTIFACT = "tables/kernels.json"


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
    from kb_nano.rows import geomean

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


def scenario_metrics(rows: list[dict]) -> dict[str, float]:
    """Per passed row, its speedup named :func:`~kb_nano.tracking.store.row_metric_name`,
    e.g. ``speedup/rms_norm/rms_norm__llama31-8b__tp1__n64 torch_fused``: the same row has
    the same name in every run, so MLflow charts it across runs. The row's interval and
    medians are in the run's table (:func:`table_rows`), not metrics: the UI's metrics tab
    draws one chart per metric. None and non-finite speedups are left out."""
    m: dict[str, float] = {}
    for r in rows:
        v = r.get("speedup")
        if r["status"] == "passed" and v is not None and math.isfinite(float(v)):
            m[row_metric_name(r)] = float(v)
    return m


def table_rows(rows: list[dict]) -> list[dict]:
    """The rows as the run's table artifact shows them: :data:`TABLE_COLUMNS` only, sorted
    by scenario and candidate, numbers other than integers to 4 significant digits (the
    full values are in the run's ``results/`` files)."""
    ordered = sorted(rows, key=lambda r: (r["scenario_id"], r["candidate"]))
    return [{k: four_digits(r.get(k)) for k in TABLE_COLUMNS} for r in ordered]


NOTE_TAG = "mlflow.note.content"  # the run's Description in the MLflow UI (Markdown)


def run_note(rows: list[dict], cands: dict[str, str | None], digest: str) -> str:
    """The run's Description (Markdown, :data:`NOTE_TAG`): the summary line and one table
    row per candidate (full id, the first 12 hex digits of its source SHA-256, rows run,
    passed, geomean speedup over passed rows), what the UI's tag chips cut short (the
    full hash is the tag ``kb_nano.candidate.<id>``)."""
    from kb_nano.rows import geomean

    m = kernel_metrics(rows)
    lines = [
        f"**kb-nano kernels**: {len(rows)} rows ({int(m['passed'])} passed, {int(m['failed'])} failed, "
        f"{int(m['skipped'])} skipped)"
        + (f"; geomean speedup over passed rows {m['geomean_speedup']:.3f}x" if "geomean_speedup" in m else ""),
        "",
        "| candidate | source sha256 (12) | rows run | passed | geomean speedup |",
        "| --- | --- | --- | --- | --- |",
    ]
    for cid in sorted(cands):
        mine = [r for r in rows if r["candidate"] == cid and r["status"] != "skipped"]
        passed = [r for r in mine if r["status"] == "passed"]
        g = geomean(r.get("speedup") for r in passed)
        lines.append(
            f"| {cid} | `{(cands[cid] or 'unknown')[:12]}` | {len(mine)} | {len(passed)} | {f'{g:.3f}x' if g else '-'} |"
        )
    lines += [
        "",
        f"targets: {_distinct(rows, 'target', ', ')}; models: {_distinct(rows, 'model', ', ')}; digest: `{digest[:12]}`",
    ]
    return "\n".join(lines)


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
    """Run params: config digest, what the run selected (the targets, models, TPs, token
    counts and variants seen in the rows; ``candidates_selected``: the config's candidate
    filter, ``all`` when empty, left out without a config), the measurement settings
    (warmup/runs/tolerances/device/dtype; from ``config`` when given, else from
    the rows), versions (kb_nano, torch, triton as measured; vLLM installed here), the git
    sha (the rows', else the checkout's now) and the device name(s)."""
    config = config or {}

    def setting(key):
        if key in config and config[key] is not None:
            return str(config[key])
        return _distinct(rows, key)

    selected = {"candidates_selected": ",".join(config["candidates"]) or "all"} if "candidates" in config else {}
    return {
        **selected,
        "config_digest": config_digest(config),
        "models": _distinct(rows, "model"),
        "tp": _distinct(rows, "tp"),
        "num_tokens": _distinct(rows, "num_tokens"),
        "dtype": _distinct(rows, "dtype"),
        "targets": _distinct(rows, "target"),
        "variants": ",".join(sorted({row_variant(r) for r in rows}, key=_natural)),
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
    tables: list[Path] | None = None,
) -> dict:
    """Log the merged kernel results (``results/kernels.parquet`` + JSON) as one run of
    ``kb_nano/kernels`` via :func:`log_run`, keyed by :func:`result_digest` of the rows,
    the manifest and the candidate hashes. Metrics: :func:`kernel_metrics` (the summary)
    and :func:`scenario_metrics` (each passed row's speedup). Artifacts: ``results/`` (Parquet, JSON,
    and ``tables``, e.g. the HTML table of :mod:`kb_nano.tracking.report_table`),
    ``plots/``, ``inputs/`` (manifest) and the table ``tables/kernels.json``
    (:func:`table_rows`, shown as a table in the UI). Writes the record as JSON to
    ``marker`` (atomic) when given and returns it.

    ``manifest_digest``: the manifest's ``inputs_digest`` this run was planned with; a
    manifest file with another one was rewritten by a concurrent invocation (the Snakefile
    computes it while parsing, before Snakemake's lock), and logging it would attach the
    wrong provenance: raises ``KbNanoError`` instead.

    A result set whose every row an existing run already holds as the same measurement
    (a filtered rerun that reused every shard: :func:`kb_nano.tracking.recorded.recorded_in`)
    creates no run: the record names those runs (``recorded_in``, ``created: False``)."""
    from kb_nano.kernels.manifest import load as load_manifest

    if manifest_digest is not None and load_manifest(manifest).get("inputs_digest") != manifest_digest:
        raise KbNanoError(
            f"{manifest} was rewritten by another kb_nano/snakemake invocation while this one ran; "
            "rerun this command to log its results (its rows are kept)"
        )
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
        NOTE_TAG: run_note(rows, cands, digest),
    }
    params = kernel_params(rows, config, root)
    record = log_run(
        tier=tier,
        tracking_uri=tracking_uri,
        digest=digest,
        params=params,
        metrics={**kernel_metrics(rows), **scenario_metrics(rows)},
        tags=tags,
        artifacts={
            "results": [Path(parquet), Path(json_path), *(Path(t) for t in tables or ())],
            "plots": [Path(p) for p in plots],
            "inputs": [Path(manifest)],
        },
        tables={TABLE_ARTIFACT: table_rows(rows)},
        spans=[row_span_ms(r) for r in rows],
        marker=marker,
        recorded=lambda c, experiment_id: recorded_in(c, tracking_uri, experiment_id, tier, rows, cands),
        row_keys=[f"{r['scenario_id']} {r['candidate']}" for r in rows],
    )
    return record
