"""Real runs through Snakemake from the CLI, Snakemake-only actions after `--`, and the job
parameters a CPU run ignores."""

from __future__ import annotations

import json

import pytest
from workflow_helpers import kb_nano


@pytest.mark.slow
def test_kernels_runs_the_dag_and_prints_the_table(work, tmp_path):
    out_json = tmp_path / "k.json"
    args = (
        "kernels",
        "--target",
        "rms_norm",
        "--model",
        "llama32-1b",
        "--tp",
        "1",
        "--num-tokens",
        "1",
        "--num-warmup",
        "1",
        "--num-runs",
        "3",
        "--output-json",
        str(out_json),
    )
    out = kb_nano(work, *args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rms_norm__llama32-1b__tp1__n1" in out.stdout and "speedup" in out.stdout
    assert "steps" in out.stderr  # Snakemake progress was visible
    assert "Snakemake version" not in out.stderr and "Workflow ID" not in out.stderr  # not its start banner
    assert "Traceback" not in out.stderr, out.stderr  # nor any process's, the judge's end included
    doc = json.loads(out_json.read_text())
    assert {r["candidate"] for r in doc["rows"]} == {"rms_norm/torch_fused", "rms_norm/triton_rowwise"}
    assert all(r["num_runs"] >= 3 for r in doc["rows"] if r["status"] == "passed")  # at least: small calls get more
    # a deleted shard is measured again (Snakemake alone keeps the up-to-date merge and skips it)
    shard = work / "results/kernels/rms_norm/torch_fused/rms_norm__llama32-1b__tp1__n1.parquet"
    kept = work / "results/kernels/rms_norm/triton_rowwise/rms_norm__llama32-1b__tp1__n1.parquet"
    shard.unlink()
    before = kept.stat().st_mtime_ns
    again = kb_nano(work, *args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert shard.is_file() and kept.stat().st_mtime_ns == before
    # the table shows what this run measured; the reused row is counted, not shown
    assert "rms_norm/torch_fused" in again.stdout and "rms_norm/triton_rowwise" not in again.stdout, again.stdout
    assert "1 more row of this selection not shown (measured by earlier runs" in again.stdout
    assert "2 rows:" in again.stdout  # (the summary is of the whole selection)
    every = kb_nano(work, *args, "--all-rows")
    assert "rms_norm/triton_rowwise" in every.stdout and "more row" not in every.stdout, every.stdout
    # providers side by side, from the same (up-to-date) results
    side = kb_nano(work, *args, "--by-scenario", "--versus", "rms_norm/torch_fused")
    assert side.returncode == 0, side.stdout + side.stderr
    assert "rms_norm llama32-1b tp1" in side.stdout and "rms_norm/torch_fused (versus)" in side.stdout
    assert "baseline: median of the baseline times" in side.stdout
    assert "vs " in side.stdout and " ms paired" in side.stdout  # each speedup's own baseline time
    # up to date: no job, and none of Snakemake's start banner (host, version, config files) before the table
    assert "Nothing to be done" in side.stderr and "Snakemake version" not in side.stderr, side.stderr
    assert len(side.stderr.splitlines()) <= 6, side.stderr


@pytest.mark.slow
def test_snakemake_actions_that_run_no_job_print_no_table(work):
    """After a real run, `kb_nano kernels -- --unlock` (and the other Snakemake-only
    actions after `--`) prints what Snakemake says, not the previous run's table."""
    small = ["--target", "rms_norm", "--model", "llama32-1b", "--tp", "1", "--num-tokens", "1"]
    first = kb_nano(work, "kernels", *small, "--num-warmup", "1", "--num-runs", "3")
    assert first.returncode == 0 and "rms_norm__llama32-1b__tp1__n1" in first.stdout, first.stdout + first.stderr
    (work / ".snakemake/locks").mkdir(parents=True, exist_ok=True)
    (work / ".snakemake/locks/0.input.lock").write_text("stale\n")  # a crashed run's lock
    for extra, said in (
        (["--unlock"], "Unlocked working directory"),
        (["-np"], "Nothing to be done"),
        (["--list-rules"], "kernel_bench"),
        (["--summary"], "merge_kernels"),
        (["--cleanup-metadata", "results/kernels.json"], ""),  # (says nothing)
    ):
        out = kb_nano(work, "kernels", *small, "--num-warmup", "1", "--num-runs", "3", "--", *extra)
        assert out.returncode == 0, out.stdout + out.stderr
        assert said in out.stdout + out.stderr, (extra, out.stdout + out.stderr)
        for table in ("kb-nano kernels", "rms_norm__llama32-1b__tp1__n1 ", "results: ", "MLflow: "):
            assert table not in out.stdout, (extra, out.stdout)
        if extra == ["--unlock"]:
            locks = work / ".snakemake/locks"
            assert not locks.exists() or not any(locks.iterdir())


def test_snakemake_action_reads_snakemakes_own_options():
    from kb_nano.launch import snakemake_action

    assert snakemake_action(["--unl"]) == "--unlock"  # argparse abbreviation
    assert snakemake_action(["-np"]) == "--dry-run"  # short-option cluster
    assert snakemake_action(["--cm", "results/kernels.json"]) == "--cleanup-metadata"
    assert snakemake_action(["-e", "dryrun"]) == "--executor"
    assert snakemake_action(["--report"]) == "--report"
    assert snakemake_action(["--version"]) == "--help/--version"
    for runs_jobs in ([], ["--profile", "profiles/slurm"], ["-j", "4"], ["--report", "--report-after-run"]):
        assert snakemake_action(runs_jobs) is None, runs_jobs
    assert snakemake_action(["--forcerun", "merge_kernels", "-e", "slurm"]) is None


@pytest.mark.slow
def test_generate_inputs_reports_not_applicable_tp(work):
    out = kb_nano(work, "generate-inputs", "--model", "qwen25-7b", "--tp", "8", "--num-tokens", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    why = "the model cannot be deployed at tp=8 (vLLM): tp=8 does not divide num_attention_heads=28"
    assert f"n/a rotary_embedding__qwen25-7b__tp8__n1: {why}" in out.stdout
    assert f"n/a rms_norm__qwen25-7b__tp8__n1: {why}" in out.stdout  # unsharded, but no such deployment
    one = kb_nano(
        work, "generate-inputs", "--model", "qwen25-7b", "--tp", "4", "--num-tokens", "1", "--target", "rms_norm"
    )
    assert one.returncode == 0 and ": 1 scenarios for qwen25-7b; 0 not applicable" in one.stdout, (
        one.stdout + one.stderr
    )


def test_cuda_only_settings_change_no_cpu_job():
    """On a CPU run the CUDA-only settings keep their defaults in the jobs' params (so
    setting them reruns nothing) and the CLI names them."""
    from workflow_helpers import REPO

    from kb_nano import workflow as kbw
    from kb_nano.config import load

    base = {**load(REPO), "device": "cpu", "num_warmup": 1, "num_runs": 2, "timeout_s": 5}
    changed = {**base, "speedup_basis": "kernel", "cuda_graph": False, "ci_target": 0.05}
    assert kbw.settings(REPO, changed) == kbw.settings(REPO, base)
    assert kbw.cpu_ignored(REPO, changed) == ["cuda_graph=False", "speedup_basis=kernel", "ci_target=0.05"]
    on_gpu = {**changed, "device": "cuda"}
    assert kbw.cpu_ignored(REPO, on_gpu) == [] and kbw.settings(REPO, on_gpu)["speedup_basis"] == "kernel"
