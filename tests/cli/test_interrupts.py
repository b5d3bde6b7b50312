"""An interrupted run ends with one line that names the signal and where the finished
shards are; the kernel jobs it stopped end as interrupted, not as failed jobs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from workflow_helpers import copy_workflow, terminal_signals

SWEEP = ("--target", "embedding", "--model", "llama31-8b", "qwen3-8b", "--tp", "1", "4", "--num-tokens", "1", "64")
JOB_REPORTS = ("KbNanoError", "RuleException", "WorkflowError", "Traceback", "Error in rule")
# the end of the line after an interrupted kernels run: the merged file is rebuilt, not lost
REBUILT = "; results/kernels.parquet, if its merge was stopped, is rebuilt from them on the next run"


def _start(work, cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "KB_NANO_ROOT": str(work)},
        start_new_session=True,
        preexec_fn=terminal_signals,
    )


def _when_kernel_jobs_run(work, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not list((work / "results/logs/kernels").rglob("*.log")):
        assert time.monotonic() < deadline and proc.poll() is None, "no kernel job started"
        time.sleep(0.2)
    time.sleep(2)  # the judge measures


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "sig"),
    [("Ctrl-C (the terminal's process group)", "SIGINT"), ("kill -TERM", "SIGTERM"), ("kill -INT", "SIGINT")],
)
def test_an_interrupted_run_ends_with_one_line_naming_the_signal(tmp_path, how, sig):
    import psutil

    work = copy_workflow(tmp_path)
    proc = _start(work, [sys.executable, "-m", "kb_nano.cli", "kernels", *SWEEP])
    try:
        _when_kernel_jobs_run(work, proc)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        if how.startswith("Ctrl-C"):
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, getattr(signal, sig))
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 130, out
        assert out.rstrip("\n").endswith(
            f"\ninterrupted ({sig}); finished shards are kept under results/kernels/{REBUILT}"
        ), out
        assert out.count("interrupted (") == 1, out  # (the test's directory has the word too)
        assert not [r for r in JOB_REPORTS if r in out], out
        time.sleep(1)
        assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not (work / ".snakemake/locks").exists() or not any((work / ".snakemake/locks").iterdir())
        logs = "".join(p.read_text() for p in (work / "results/logs/kernels").rglob("*.log"))
        assert "interrupted (SIGINT); no row, the next run redoes this job" in logs
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_ctrl_c_in_snakemake_itself_says_each_kernel_job_was_interrupted(tmp_path):
    """`snakemake` run directly: each kernel job the Ctrl-C stopped says so in one line,
    not as a failed job's error report."""
    import yaml

    work = copy_workflow(tmp_path)
    (work / "sweep.yaml").write_text(
        yaml.safe_dump(
            {"targets": ["embedding"], "models": ["llama31-8b", "qwen3-8b"], "tp": [1, 4], "num_tokens": [1, 64]}
        )
    )
    proc = _start(work, [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "sweep.yaml"])
    try:
        _when_kernel_jobs_run(work, proc)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
        assert "interrupted (SIGINT); no row, the next run redoes this job" in out, out
        assert not [r for r in ("KbNanoError", "RuleException", "Traceback") if r in out], out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_sigterm_is_named_in_the_last_line(monkeypatch, capsys):
    """A SIGTERM while a command runs ends it as a Ctrl-C does, named as SIGTERM."""
    from kb_nano.cli import commands, parser

    def stopped(args, passthrough):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not interrupt the command")

    previous = signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(AssertionError("SIGTERM not handled")))
    try:
        monkeypatch.setattr(commands, "cmd_kernels", stopped)
        assert parser.main(["kernels"]) == 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (
        capsys.readouterr().err == f"interrupted (SIGTERM); finished shards are kept under results/kernels/{REBUILT}\n"
    )


@pytest.mark.parametrize("when", ["before its first request", "mid-reply"])
def test_a_worker_whose_judge_is_gone_exits_without_a_traceback(when):
    # an interrupted job closes its end of the pipe while a worker still starts (or is
    # about to answer): the worker's output goes to the job's stderr and must stay clean
    first = "" if when == "before its first request" else "a.send({'cmd': 'log'}); "
    code = (
        "import multiprocessing as mp\n"
        "from kb_nano.kernels import worker_process as w\n"
        f"a, b = mp.Pipe(); {first}a.close()\n"
        "w.main(b, {'role': 'baseline'})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_kb_nano_imports_is_one_line_and_130(tmp_path, sig):
    """A signal in kb_nano's first tenth of a second (while Python imports it): one line,
    status 130, no ``KeyboardInterrupt`` traceback (SIGINT) and not a silent -15 (SIGTERM)."""
    work = copy_workflow(tmp_path)
    proc = _start(work, [sys.executable, "-m", "kb_nano.cli", "kernels", "--dry-run"])
    time.sleep(0.05)
    os.killpg(proc.pid, getattr(signal, sig))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in out and "Traceback" not in out, out


def test_closed_stdout_does_not_turn_an_exit_into_a_traceback(tmp_path):
    """``kb_nano ... >&-`` where Snakemake refuses a flag while the manifest thread still
    builds modules: the command's end (past that thread) flushes what it can and keeps
    Snakemake's status, without an ``AttributeError`` traceback."""
    work = copy_workflow(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "kb_nano.cli", "kernels", "--", "--bogus-flag"],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KB_NANO_ROOT": str(work)},
        close_fds=True,
        preexec_fn=lambda: os.close(1),
    )
    assert proc.returncode not in (0, 1) and "Traceback" not in proc.stderr, proc.stderr
