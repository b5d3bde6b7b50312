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
