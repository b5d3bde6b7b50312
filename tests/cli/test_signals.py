"""Signals to kb_nano or to its workers, and Ctrl-C at any point of a command: the run stops,
says so in one line and leaves no process."""

from __future__ import annotations

import os

import pytest
from workflow_helpers import copy_workflow


def _ignore_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what `cmd &` in a non-interactive shell does


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGINT, started with SIGINT ignored"])
def test_a_signal_to_kb_nano_alone_stops_the_whole_run(tmp_path, sig):
    # kill -INT / -TERM to the kb_nano process only (a script, nohup, a scheduler, a
    # background job whose shell set SIGINT to ignored): the Snakemake run below it stops
    # too, keeps what finished and leaves no process behind
    import signal
    import subprocess
    import sys
    import time

    import psutil

    work = copy_workflow(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kb_nano.cli",
            "kernels",
            "--target",
            "embedding",
            "--model",
            "llama31-8b",
            "qwen3-8b",
            "--tp",
            "1",
            "4",
            "--num-tokens",
            "1",
            "64",
        ],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "KB_NANO_ROOT": str(work)},
        start_new_session=True,
        preexec_fn=_ignore_sigint if "ignored" in sig else None,
    )
    sig = sig.split(",")[0]
    try:
        deadline = time.monotonic() + 120
        while not list((work / "results/logs/kernels").rglob("*.log")) and time.monotonic() < deadline:
            time.sleep(0.2)  # a kernel job is running
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert descendants, "no Snakemake process started"
        t0 = time.monotonic()
        os.kill(proc.pid, getattr(signal, sig))
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 130, out
        assert time.monotonic() - t0 < 15, "took too long to stop (the run itself takes ~40 s)"
        assert "interrupted" in out and "Traceback" not in out.split("WorkflowError")[-1]
        time.sleep(1)
        assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not (work / ".snakemake/locks").exists() or not any((work / ".snakemake/locks").iterdir())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("argv", "func", "kept"),
    [
        (["eval", "--dry-run"], "cmd_eval", "results/eval/"),
        (["e2e", "latency", "--dry-run"], "cmd_e2e", "results/e2e/"),
        (["kernels"], "cmd_kernels", "results/kernels/"),
        (["history"], "cmd_history", None),
    ],
)
def test_ctrl_c_names_where_that_commands_finished_work_is(monkeypatch, capsys, argv, func, kept):
    """A Ctrl-C ends any command with one line and status 130, naming the folder that
    command's finished shards are in (an interrupted `kb_nano eval` said results/kernels/)."""
    from kb_nano.cli import commands, parser

    def interrupted(args, passthrough):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, func, interrupted)
    assert parser.main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("interrupted")
    assert (kept in err) if kept else ("kept" not in err)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGKILL"])
def test_sigint_to_the_workers_alone_ends_their_job_and_the_run(tmp_path, sig):
    """SIGINT that reaches the measurement workers but not Snakemake (`pkill -INT` from a
    script, a sweep under nohup whose workers share a terminal's group), or SIGKILL (`kill
    -9`, the OOM killer), which the candidate cannot send the baseline: the job they served
    fails as interrupted (no row: the next run redoes it) and Snakemake ends the run, or,
    when only the candidate's worker got it, the job ends with a ``crashed`` row; either
    way nothing hangs and no process is left behind. (An engine that ran candidates inside Snakemake's job lost the
    interruption and froze the run.)"""
    import contextlib
    import signal
    import subprocess
    import sys
    import time

    import psutil

    work = copy_workflow(tmp_path)
    argv = ["kernels", "--target", "embedding", "--model", "llama31-8b", "qwen3-8b", "--tp", "1", "4"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kb_nano.cli", *argv, "--num-tokens", "1", "64"],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "KB_NANO_ROOT": str(work)},
        start_new_session=True,
    )
    try:

        def workers() -> list:
            """The measurement workers: forked by the workers' fork server, which the judge
            started, which the judge's fork server forked (four generations of fork-server
            command lines; the workers' fork server itself has three)."""
            found = []
            for p in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error, AttributeError):
                    chain = [p, p.parent(), p.parent().parent(), p.parent().parent().parent()]
                    if all("forkserver" in " ".join(q.cmdline()) for q in chain):
                        found.append(p)
            return found

        deadline = time.monotonic() + 120
        while not (list((work / "results/logs/kernels").rglob("*.log")) and workers()):
            assert time.monotonic() < deadline, "no kernel job with workers started"
            time.sleep(0.2)
        time.sleep(1)  # the rest of the job's workers
        descendants = psutil.Process(proc.pid).children(recursive=True)
        hit = workers()
        for p in hit:
            os.kill(p.pid, getattr(signal, sig))
        out, _ = proc.communicate(timeout=240)
        # the baseline's worker interrupted: the job fails without a row (Snakemake ends the
        # run); only the candidate's: its death is the candidate's row, the run goes on
        if proc.returncode == 1:
            assert f"interrupted ({sig}); no row, the next run redoes this job" in out, out
            assert "the Snakemake workflow failed" in out
            assert "harness error" not in out and "Traceback" not in out, out
        else:
            assert proc.returncode == 0 and f"the candidate worker died of {sig}" in out, out
        time.sleep(1)
        assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["Snakemake starting", "a fork server starting"])
def test_ctrl_c_while_kb_nano_starts_is_quiet(tmp_path, when):
    """Ctrl-C in the terminal (SIGINT to kb_nano's process group) while Snakemake is still
    importing or parsing, or while the judges' fork server is importing: the run ends
    with status 130, says it was interrupted, prints no traceback and leaves no process.
    Nine models keep kb_nano's manifest thread building modules when the signal comes: the
    interpreter's shutdown once ended that thread inside torch's C++ code and the process
    aborted ("terminate called without an active exception", status -6)."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    work = copy_workflow(tmp_path)
    models = ["llama31-8b", "llama31-70b", "qwen3-8b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-20b"]
    models += ["llama4-scout", "phi35-moe", "gemma3-4b"]
    cmd = [sys.executable, "-m", "kb_nano.cli", "kernels", "--target", "rms_norm", "--model", *models]
    proc = subprocess.Popen(
        [*cmd, "--tp", "1", "--num-tokens", "1"],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "KB_NANO_ROOT": str(work), "XDG_CACHE_HOME": str(tmp_path / "cache")},
        start_new_session=True,
    )

    def started(p: psutil.Process) -> bool:
        cmdline = " ".join(p.cmdline())
        return "forkserver" in cmdline if "fork server" in when else "snakemake_main" in cmdline

    try:
        deadline, seen = time.monotonic() + 60, []
        while not seen and time.monotonic() < deadline and proc.poll() is None:
            try:
                seen = [p for p in psutil.Process(proc.pid).children(recursive=True) if started(p)]
            except psutil.Error:
                pass
            time.sleep(0.02)
        assert seen, f"{when}: not seen"
        descendants = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        assert "interrupted" in out and "Traceback" not in out, out
        time.sleep(1)
        assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
