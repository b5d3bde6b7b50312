"""Helpers for tests that run the real Snakemake workflow in a temporary copy."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# the vendored tiny Llama (a model folder, relative to the repository or a copy of the workflow)
TINY = "config/models/kb-nano/tiny-llama"
COPY = ("Snakefile", "workflow", "config", "candidates", "profiles", "envs")

SMALL = {
    "models": ["llama32-1b"],
    "tp": [1],
    "num_tokens": [1],
    "targets": ["rms_norm", "silu_and_mul"],
    "num_warmup": 1,
    "num_runs": 5,
}


def terminal_signals() -> None:
    """A ``preexec_fn``: the child starts with SIGINT's default action and SIGINT/SIGTERM
    unblocked, as a command started from a terminal does, whatever the test runner's own
    disposition (pytest started as ``cmd &`` from a script has SIGINT ignored, which a
    child would inherit and Python would then leave ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def copy_workflow(dest: Path, extra_config: dict | None = None) -> Path:
    """Copy the workflow files into ``dest`` and write ``small.yaml`` there."""
    for name in COPY:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    (dest / "small.yaml").write_text(yaml.safe_dump({**SMALL, **(extra_config or {})}))
    return dest


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m snakemake`` in ``workdir`` with the small config."""
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "small.yaml", *args]
    proc = subprocess.run(
        cmd, cwd=workdir, capture_output=True, text=True, env={**os.environ, "KB_NANO_ROOT": str(workdir)}
    )
    if check and proc.returncode:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def kb_nano(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the ``kb_nano`` CLI with ``KB_NANO_ROOT`` pointing at ``workdir``."""
    return subprocess.run(
        [sys.executable, "-m", "kb_nano.cli", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        env={**os.environ, "KB_NANO_ROOT": str(workdir), "COLUMNS": "200"},
    )
