"""Tiers 2 and 3 in MLflow: params, summary metrics and the run of an e2e or eval result set."""

from __future__ import annotations

import math
from pathlib import Path

import kb_nano
from kb_nano.provenance import git_sha, package_version
from kb_nano.tracking.digest import e2e_candidate_hashes, result_digest
from kb_nano.tracking.kernels import _distinct, config_digest, read_parquet_rows
from kb_nano.tracking.runs import log_run, row_span_ms
from kb_nano.tracking.store import CANDIDATE_TAG_PREFIX


def e2e_metrics(rows: list[dict]) -> dict[str, float]:
    """Metrics of an e2e result set (None values dropped): ``rows``, ``scenarios_run``
    (the rows not ``skipped``, as Tier 1 counts them), ``ok``, ``failed`` (run and not ok),
    ``pass_rate`` (ok / run), ``geomean_speedup`` (over the ok
    candidate-variant rows; what ``kb_nano history`` shows),
    ``status/<status>`` counts, and per ok row ``<metric>/<model>/tp<tp>/<workload>/<variant>``
    for ``total_tokens_per_s``, ``output_tokens_per_s``, ``requests_per_s`` (throughput),
    ``avg_latency_ms``, ``p50_latency_ms``, ``p99_latency_ms`` (latency), ``speedup`` and
    its 95% rerun interval ``speedup_ci_low``/``speedup_ci_high`` (over the pairs), plus ``geomean_speedup/<variant>`` over the variant's ok rows (``+`` in a variant
    name is a space in metric names: MLflow does not allow ``+``)."""
    from kb_nano.rows import geomean

    ok = [r for r in rows if r["status"] == "ok"]
    run = [r for r in rows if r["status"] != "skipped"]
    m: dict[str, float | None] = {
        "rows": len(rows),
        "scenarios_run": len(run),
        "ok": len(ok),
        "failed": len(run) - len(ok),
        "pass_rate": len(ok) / len(run) if run else None,
        "geomean_speedup": geomean(r.get("speedup") for r in ok if r["variant"] != "baseline"),
    }
    for status in sorted({r["status"] for r in rows}):
        m[f"status/{status}"] = sum(r["status"] == status for r in rows)
    keys = (
        "total_tokens_per_s",
        "output_tokens_per_s",
        "requests_per_s",
        "avg_latency_ms",
        "p50_latency_ms",
        "p99_latency_ms",
        "speedup",
        "speedup_ci_low",
        "speedup_ci_high",
    )
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
        params.update(
            {
                "smoke": str(bool(ev.get("smoke"))),
                "num_prompts": str(ev.get("num_prompts", "")),
                "gpu_pool": str(ev.get("gpu_pool", "")),
            }
        )
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
        spans=[row_span_ms(r) for r in rows],
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
