"""``profiles/slurm`` against a real one-node SLURM cluster started on this machine.

The cluster (tests/workflow/slurm_cluster.py) is Debian's slurmctld + slurmd + munge, installed
with apt-get when missing, with a fake two-GPU generic resource and no accounting
database, so the plugin reads job states with ``squeue`` (``--slurm-status-command
squeue``; the cluster keeps finished jobs for ``MinJobAge`` = 600 s). Every kernel job
must go through ``sbatch`` (and run its step with ``srun``, whose failure fails the
job); the merged rows must equal a local run's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from slurm_cluster import GPU_TYPE, NODE, PARTITION, LocalSlurmCluster, SlurmUnavailable
from workflow_helpers import copy_workflow, snakemake

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

# Options for this test cluster only (no accounting, jobs of a few seconds); the
# profile itself is used as shipped.
CLUSTER_ARGS = (
    "--slurm-status-command",
    "squeue",
    "--slurm-init-seconds-before-status-checks",
    "2",
)
# the same rows either way (errors depend on the measurement's seed, drawn from the OS each time)
DETERMINISTIC = ["scenario_id", "candidate", "status", "device", "sandbox"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o700)
    c = LocalSlurmCluster(root)
    try:
        c.__enter__()
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield c
    finally:
        c.stop()


def _submitted(workdir: Path) -> dict[str, str]:
    """Snakemake's own record of submissions: SLURM job id -> the job's SLURM log."""
    logs = sorted((workdir / ".snakemake/log").glob("*.snakemake.log"))
    text = logs[-1].read_text()
    return dict(re.findall(r"submitted with SLURM jobid (\d+) \(log: (\S+?)\)", text))


def _job(cluster: LocalSlurmCluster, job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (finished jobs stay for MinJobAge)."""
    out = cluster.run("scontrol", "show", "job", job_id, "--oneliner").stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def _workdir(path: Path) -> Path:
    path.mkdir()
    return copy_workflow(path)


def _rows(workdir: Path) -> pd.DataFrame:
    rows = pd.read_parquet(workdir / "results/kernels.parquet")[DETERMINISTIC]
    return rows.sort_values(["scenario_id", "candidate"]).reset_index(drop=True)


def _run(cluster: LocalSlurmCluster, workdir: Path, cmd: list[str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ``workdir`` as a client of ``cluster``; on failure the assertion
    carries its output and the SLURM jobs' logs."""
    proc = subprocess.run(
        cmd,
        cwd=workdir,
        capture_output=True,
        text=True,
        env={**cluster.env(), "KB_NANO_ROOT": str(workdir), "COLUMNS": "200"},
    )
    if proc.returncode:
        job_logs = "".join(
            f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted((workdir / ".snakemake/slurm_logs").rglob("*.log"))
        )
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}\n{job_logs}"
        )
    return proc


def _check_jobs(cluster, workdir: Path, n_jobs: int, gres: str) -> None:
    submitted = _submitted(workdir)
    # only kernel_bench is submitted; the manifest is parse-time, merge, plots and MLflow are local rules
    assert len(submitted) == n_jobs, submitted
    assert all("/rule_kernel_bench/" in log for log in submitted.values()), submitted
    ctld_log = (cluster.root / "slurmctld.log").read_text()
    names = set()
    for job_id in submitted:
        assert f"_slurm_rpc_submit_batch_job: JobId={job_id} " in ctld_log  # it came in through sbatch
        job = _job(cluster, job_id)
        assert job["JobState"] == "COMPLETED", job
        assert job["BatchFlag"] == "1" and job["Partition"] == PARTITION and job["NodeList"] == NODE, job
        assert job["TresPerJob"] == gres, job  # the rule's gpu (and gpu_model) resource became --gpus
        assert job["WorkDir"] == str(workdir), job
        names.add(job["JobName"])
    assert len(names) == 1  # one SLURM run id for the whole sweep


def test_sweep_through_sbatch_matches_local_run(cluster, tmp_path):
    local = _workdir(tmp_path / "local")
    snakemake(local)

    remote = _workdir(tmp_path / "slurm")
    _run(
        cluster,
        remote,
        [sys.executable, "-m", "snakemake", "--profile", "profiles/slurm", "--configfile", "small.yaml", *CLUSTER_ARGS],
    )

    # small.yaml: rms_norm and silu_and_mul on one scenario each, two candidates each;
    # device auto -> kernel_bench declares gpu=1 -> sbatch --gpus=1
    _check_jobs(cluster, remote, 4, "gres:gpu:1")
    slurm_rows, local_rows = _rows(remote), _rows(local)
    assert len(slurm_rows) == 4
    assert set(slurm_rows["status"]) == {"passed", "skipped"}
    pd.testing.assert_frame_equal(slurm_rows, local_rows)
    assert (remote / "results/plots/kernels_speedup.png").exists()
    assert (remote / "results/mlflow/kernels.json").exists()


def test_cli_passthrough_with_gpu_model(cluster, tmp_path):
    workdir = _workdir(tmp_path / "cli")
    proc = _run(
        cluster,
        workdir,
        [
            sys.executable,
            "-m",
            "kb_nano.cli",
            "kernels",
            "--configfile",
            "small.yaml",
            "--target",
            "rms_norm",
            "--",
            "--profile",
            "profiles/slurm",
            *CLUSTER_ARGS,
            "--resources",
            "gpu=1",
            "--set-resources",
            f"kernel_bench:gpu_model={GPU_TYPE}",
        ],
    )
    _check_jobs(cluster, workdir, 2, f"gres:gpu:{GPU_TYPE}:1")
    # set-resource-scopes gpu=local: the --resources gpu=1 cap is per submitted job, so
    # both GPU jobs were queued before either finished (a global cap would submit one).
    ctld_log = (cluster.root / "slurmctld.log").read_text()
    ids = list(_submitted(workdir))
    last_submit = max(ctld_log.index(f"_slurm_rpc_submit_batch_job: JobId={i} ") for i in ids)
    first_done = min(ctld_log.index(f"_job_complete: JobId={i} ") for i in ids)
    assert last_submit < first_done
    assert "2 rows" in proc.stdout, proc.stdout
    assert set(_rows(workdir)["candidate"]) == {"rms_norm/torch_fused", "rms_norm/triton_rowwise"}
