"""A file where kb-nano writes a directory: one line naming it and the fix, before
anything is written, and the file and the results already there are left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from workflow_helpers import copy_workflow, kb_nano

RUN = ("kernels", "--target", "rms_norm", "--model", "llama32-1b", "--tp", "1", "--num-tokens", "1")
FIX = "kb-nano writes its results under this directory; move or delete it"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("dirs"))


def _clear(work) -> None:
    import shutil

    for name in ("results", ".snakemake"):
        p = work / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


@pytest.mark.parametrize(
    "blocked",
    [
        "results",
        "results/kernels",
        "results/inputs",
        "results/logs",
        "results/mlflow",
        "results/plots",
        "results/kernels/rms_norm",
        "results/logs/kernels/rms_norm/torch_fused",
    ],
)
def test_a_file_where_results_go_is_one_line(work, blocked):
    _clear(work)
    (work / blocked).parent.mkdir(parents=True, exist_ok=True)
    (work / blocked).write_text("mine\n")
    kept = work / "results/kernels.parquet"  # the merged rows of an earlier run
    if blocked != "results":
        kept.write_text("earlier rows\n")
    out = kb_nano(work, *RUN)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr == f"error: {blocked}: is a file, {FIX}\n", out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert (work / blocked).read_text() == "mine\n"
    assert blocked == "results" or kept.read_text() == "earlier rows\n"


def test_a_file_where_snakemake_keeps_its_state_is_one_line(work):
    _clear(work)
    (work / ".snakemake").write_text("mine\n")
    out = kb_nano(work, *RUN)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: .snakemake: is a file, Snakemake keeps its run state under this directory")
    assert (work / ".snakemake").read_text() == "mine\n"


def test_a_file_on_the_output_json_path_is_one_line(work, tmp_path):
    _clear(work)
    (tmp_path / "out").write_text("mine\n")
    out = kb_nano(work, *RUN, "--output-json", str(tmp_path / "out/sub/kernels.json"))
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"error: --output-json {tmp_path}/out/sub/kernels.json: {tmp_path}/out: is a file, {FIX}\n"


def test_the_workflow_itself_names_a_file_in_a_jobs_directory(work):
    # `snakemake` without the CLI: the kernel jobs' directories are checked as the DAG is
    # built, before Snakemake scans them (NotADirectoryError)
    _clear(work)
    (work / "results/kernels/rms_norm").mkdir(parents=True)
    (work / "results/kernels/rms_norm/torch_fused").write_text("mine\n")
    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", "--configfile", "small.yaml", "-n"],
        cwd=work,
        capture_output=True,
        text=True,
        env={**os.environ, "KB_NANO_ROOT": str(work)},
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert f"kb-nano: results/kernels/rms_norm/torch_fused: is a file, {FIX}" in text, text
    assert "NotADirectoryError" not in text


def test_the_cli_says_which_file_stops_its_own_writes(monkeypatch, capsys, tmp_path):
    """A write of the CLI itself (a directory it creates) under a file: one line."""
    from kb_nano.cli import commands, parser

    (tmp_path / "f").write_text("mine\n")

    def writes(args, passthrough):
        (tmp_path / "f/sub").mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(commands, "cmd_history", writes)
    assert parser.main(["history"]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}/f: is a file, {FIX}\n"


def test_an_output_json_error_names_the_flag_or_the_file_that_set_it(work, tmp_path):
    """(kb_nano.checks: the same check as the Snakefile's, the key mapped back to its origin)"""
    _clear(work)
    why = "that path belongs to another kb-nano output; pick another"
    out = kb_nano(work, "eval", "--output-json", "results/kernels/x.json", "--dry-run")
    assert out.returncode == 2 and out.stderr == f"error: --output-json results/kernels/x.json: {why}\n", out.stderr
    cfg = tmp_path / "eval.yaml"
    cfg.write_text("eval:\n  output_json: results/kernels/x.json\n")
    out = kb_nano(work, "eval", "--configfile", str(cfg), "--dry-run")
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"error: {cfg}: eval.output_json: results/kernels/x.json: {why}\n", out.stderr
