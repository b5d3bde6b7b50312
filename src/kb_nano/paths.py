"""Where the workflow, configs and candidates live (torch-free, cheap to import)."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def find_workflow_root(start: Path | None = None) -> Path:
    """Return the directory holding the kb-nano ``Snakefile``.

    Search order: ``$KB_NANO_ROOT``, then ``start`` (default: the current directory)
    and its parents, then the source checkout this package was installed from
    (editable install). Raises ``KbNanoError`` when none holds a ``Snakefile``.
    """
    from kb_nano.errors import KbNanoError

    env = os.environ.get("KB_NANO_ROOT")
    if env:
        root = Path(env).resolve()
        if (root / "Snakefile").is_file():
            return root
        raise KbNanoError(f"KB_NANO_ROOT={env}: no Snakefile there; point it at the kb-nano checkout")
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "Snakefile").is_file() and (candidate / "workflow").is_dir():
            return candidate
    checkout = PACKAGE_DIR.parents[1]
    if (checkout / "Snakefile").is_file():
        return checkout
    raise KbNanoError("no kb-nano Snakefile in the current directory or its parents; cd into the kb-nano checkout")
