"""Where a number came from: git commit and package versions (torch-free)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_sha(root: Path) -> str | None:
    """``git rev-parse HEAD`` of ``root`` plus ``-dirty`` when tracked files changed;
    None outside a git checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if sha.returncode:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None
