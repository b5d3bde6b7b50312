"""Atomic file writes: a temporary file in the target's directory, renamed into place, so
a killed job never leaves a half-written shard, manifest or report (torch-free)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path):
    """Yield a temporary path next to ``path``; when the block succeeds, give it the
    permissions a plain ``open()`` would (0666 minus the umask) and rename it onto
    ``path``. On error the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def user_cache_dir(*parts: str) -> Path:
    """kb-nano's folder in the user's cache, ``$XDG_CACHE_HOME/kb_nano`` (default
    ``~/.cache/kb_nano``, the XDG base-directory convention), joined with ``parts``: the
    scenario manifests (:func:`kb_nano.kernels.manifest.cached`) and the candidates' compiler
    caches (:func:`kb_nano.kernels.pool.cache_dir`). Not created here."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "kb_nano", *parts)


# The directories every run may write under, relative to the workflow root (the tiers'
# shards, logs, manifests, plots, MLflow markers and Snakemake's own state).
OUTPUT_DIRS = (
    "results",
    *(f"results/{d}" for d in ("kernels", "e2e", "eval", "golden", "inputs", "logs", "mlflow", "plots")),
    *(f"results/logs/{d}" for d in ("kernels", "e2e", "eval", "capture_golden")),
    ".snakemake",
    *(f".snakemake/{d}" for d in ("locks", "metadata", "incomplete", "log", "auxiliary", "scripts")),
)


def blocking_file(path: Path) -> Path | None:
    """The nearest of ``path`` and its parents that exists but is not a directory (a
    regular file, a broken link): what stops anything being written under ``path``. None
    when the nearest existing one is a directory."""
    for p in (Path(path), *Path(path).parents):
        if os.path.lexists(p):
            return None if p.is_dir() else p
    return None


def not_a_directory(blocker: Path, root: Path | None = None) -> str:
    """The one-line message for ``blocker`` (:func:`blocking_file`), shown relative to
    ``root`` when under it: what it is, why it must be a directory and the fix."""
    shown = Path(blocker)
    if root is not None:
        with contextlib.suppress(ValueError):
            shown = Path(os.path.abspath(root / blocker)).relative_to(os.path.abspath(root))
    what = "is a file" if Path(blocker).is_file() else "is not a directory"
    writer = "Snakemake keeps its run state" if ".snakemake" in shown.parts else "kb-nano writes its results"
    return f"{shown}: {what}, {writer} under this directory; move or delete it"


def check_dirs(root: Path, dirs) -> None:
    """Raise ``KbNanoError`` (:func:`not_a_directory`) for the first of ``dirs`` (relative
    to ``root`` or absolute) that a file stops kb-nano from creating or writing under; the
    file itself is left alone. Each distinct directory is looked at once."""
    from kb_nano.errors import KbNanoError

    for d in dict.fromkeys(str(d) for d in dirs):
        blocker = blocking_file(Path(root) / d)
        if blocker is not None:
            raise KbNanoError(not_a_directory(blocker, Path(root)))
