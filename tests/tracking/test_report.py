"""End to end, in a temporary copy of the workflow: a tiny real Snakemake sweep records
one MLflow run; re-running without changes (and forcing the log rule) adds none; editing
one candidate and re-running through ``kb_nano kernels`` adds exactly one; ``kb_nano
history`` lists them; ``snakemake --report`` renders the plots and the merged table into
an HTML report."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from workflow_helpers import copy_workflow

from kb_nano import tracking
from kb_nano.tracking import history

TINY = """\
targets: [rms_norm]
models: [llama32-1b]
tp: [1]
num_tokens: [1]
num_runs: 5
num_warmup: 1
"""


def _env(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return {**env, "KB_NANO_ROOT": str(root)}


def _snakemake(root: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "tiny.yaml", *extra]
    proc = subprocess.run(cmd, cwd=root, env=_env(root), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = copy_workflow(tmp_path_factory.mktemp("kbwf"))
    (root / "tiny.yaml").write_text(TINY)
    return root


@pytest.mark.slow
def test_sweep_is_logged_once_per_result_set_and_reported(workdir):
    root = workdir
    uri = tracking.default_tracking_uri(root)
    assert uri == f"sqlite:///{root.resolve()}/results/mlflow.db"

    _snakemake(root)
    marker = json.loads((root / "results/mlflow/kernels.json").read_text())
    assert marker["created"] and marker["tracking_uri"] == uri and marker["experiment"] == "kb_nano/kernels"
    runs = history.list_runs(uri)
    assert [r["run_id"] for r in runs] == [marker["run_id"]]
    assert runs[0]["candidates"] == ["rms_norm/torch_fused", "rms_norm/triton_rowwise"]
    client = tracking.client(uri)
    arts = {a.path for d in ("results", "plots", "inputs") for a in client.list_artifacts(marker["run_id"], d)}
    assert {
        "results/kernels.parquet",
        "results/kernels.json",
        "results/kernels_table.html",
        "plots/kernels_speedup.png",
        "plots/kernels_bandwidth.png",
        "plots/kernels_perf_time.png",
        "plots/kernels_perf_gbs.png",
    } <= arts
    assert [a for a in arts if a.startswith("inputs/")] == [
        f"inputs/{next((root / 'results/inputs').glob('llm-*')).name}"
    ]

    # Unchanged inputs: nothing to do, and forcing the log rule keeps the run.
    assert "Nothing to be done" in _snakemake(root).stderr
    _snakemake(root, "--forcerun", "log_mlflow_kernels")
    again = json.loads((root / "results/mlflow/kernels.json").read_text())
    assert not again["created"] and again["run_id"] == marker["run_id"]
    assert len(history.list_runs(uri)) == 1

    # `kb_nano history` (the CLI) shows it.
    out = subprocess.run(
        [sys.executable, "-m", "kb_nano.cli", "history"],
        cwd=root,
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert marker["run_id"][:12] in out.stdout and "rms_norm/torch_fused" in out.stdout

    # One edited candidate -> its jobs rerun -> exactly one new run (through `kb_nano kernels`).
    cand = root / "candidates/rms_norm/torch_fused.py"
    cand.write_text(cand.read_text() + "\n# edited by the test\n")
    out = subprocess.run(
        [sys.executable, "-m", "kb_nano.cli", "kernels", "--configfile", "tiny.yaml", "--cores", "2"],
        cwd=root,
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "MLflow: new run" in out.stdout
    runs = history.list_runs(uri)
    assert len(runs) == 2 and runs[1]["run_id"] == marker["run_id"]
    new = client.get_run(runs[0]["run_id"]).data.tags
    assert new["kb_nano.candidate.rms_norm/torch_fused"] == tracking.file_sha256(cand)
    assert len(history.list_runs(uri, candidate="rms_norm/triton_rowwise")) == 2

    # The Snakemake report embeds the plots and the merged table with their captions.
    _snakemake(root, "--report", "report.html")
    html = (root / "report.html").read_text()
    for name in ("kernels_speedup.png", "kernels_bandwidth.png", "kernels_perf_time.png", "kernels_perf_gbs.png"):
        assert f"{name};base64,iVBORw0KGgo" in html  # the PNG itself, embedded
    table = base64.b64encode((root / "results/kernels_table.html").read_bytes()).decode()
    assert f"kernels_table.html;base64,{table}" in html
    assert "Speedup of each candidate over the PyTorch baseline" in html
    assert "Roofline-style view of the passed rows" in html
    assert "Median time per call (ms, log scale) against the token count" in html
    assert "The merged rows of" in html
