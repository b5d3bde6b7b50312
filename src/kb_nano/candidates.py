"""Candidate discovery and loading.

A candidate is ``candidates/{target}/{name}.py`` defining exactly one ``nn.Module``
subclass with the baseline's constructor signature and ``state_dict`` keys. Its id is
``{target}/{name}``. An optional class attribute ``supported_devices`` (default
``("cpu", "cuda")``) lists the device types it runs on. Discovery is torch-free (used at
Snakefile parse time); loading imports the file. A candidate's exception becomes one
line for its row (:func:`explain`), naming the candidate's own file and line.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kb_nano import operators
from kb_nano.errors import KbNanoError

CANDIDATES_DIR = Path("candidates")
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
DEFAULT_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class CandidateRef:
    """A discovered candidate file: ``id`` is ``{target}/{name}``, ``path`` relative to the root."""

    target: str
    name: str
    path: Path

    @property
    def id(self) -> str:
        return f"{self.target}/{self.name}"


class CandidateError(Exception):
    """A candidate file that cannot be used; ``status`` is the row status
    (``import_error``) and the message is one line."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


def discover(root: Path, directory: Path = CANDIDATES_DIR) -> list[CandidateRef]:
    """All ``{directory}/{target}/{name}.py`` under ``root`` (files starting with ``_`` are
    helpers, not candidates), sorted by id.

    Raises ``KbNanoError`` for a directory that is not a known target or a file name that
    is not a Python identifier.
    """
    base = root / directory
    found = []
    for path in sorted(base.glob("*/*.py")):
        if path.name.startswith(("_", ".")):  # helpers; editor lock/backup files
            continue
        target = path.parent.name
        rel = path.relative_to(root)
        operators.check_target(target, where=str(rel))
        if not _NAME_RE.match(path.stem):
            raise KbNanoError(
                f"{rel}: candidate file names must be Python identifiers (start with a letter; letters, digits, _)"
            )
        found.append(CandidateRef(target, path.stem, rel))
    return found


def file_sha256(path: Path) -> str:
    """SHA-256 of a candidate file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def helper_files(folder: Path) -> list[Path]:
    """The helpers the candidate files in ``folder`` (``candidates/<target>``) may import:
    its files whose names start with ``_`` (``_common.py``) and every file of its ``_``
    packages (``_pkg/__init__.py``), compiled caches left out; sorted."""
    found = []
    for p in Path(folder).glob("_*"):
        if p.is_file() and p.suffix == ".py":
            found.append(p)
        elif p.is_dir() and p.name != "__pycache__":
            found += [q for q in p.rglob("*") if q.is_file() and "__pycache__" not in q.parts]
    return sorted(found)


def candidate_digest(path: Path) -> str:
    """SHA-256 over a candidate file's bytes and its :func:`helper_files` (each with its
    path relative to the candidate's folder): what a change of the candidate's code changes."""
    h = hashlib.sha256(Path(path).read_bytes())
    for p in helper_files(Path(path).parent):
        h.update(b"\0" + p.relative_to(Path(path).parent).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def load_class(path: Path, target: str):
    """Import a candidate file and return its single ``nn.Module`` subclass.

    Raises ``CandidateError('import_error', ...)`` if the file fails to import or does
    not define exactly one ``nn.Module`` subclass of its own.
    """
    import torch

    module_name = f"kb_nano_candidate_{target}_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(Path(path).resolve().parent))  # so `import _helpers` works
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        import traceback

        traceback.print_exc()  # to the job log
        hint = SANDBOX_HINT if isinstance(exc, PermissionError) else ""
        where = _candidate_frame(exc)
        where = f" (at {where})" if where else ""
        raise CandidateError("import_error", f"{path}: import failed: {one_line(exc)}{where}{hint}") from None
    classes = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__module__ == module_name
    ]
    if len(classes) != 1:
        found = ", ".join(c.__name__ for c in classes) or "none"
        raise CandidateError(
            "import_error", f"{path}: must define exactly one nn.Module subclass for {target} (found: {found})"
        )
    return classes[0]


# what a PermissionError in a candidate's code most likely met (kernels.sandbox, kernels.seccomp)
SANDBOX_HINT = (
    " (candidates run sandboxed: they may write only under tempfile.gettempdir() and their cache "
    "directory, and may not set an action for SIGCHLD; see docs/measurement.md)"
)


def one_line(exc: BaseException) -> str:
    """``TypeName: message`` on one line, at most 300 characters."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300]


def explain(exc: BaseException) -> str:
    """One line for a row, the traceback to the job log; a ``PermissionError`` says why
    (the sandbox) and where a candidate may write."""
    import traceback

    traceback.print_exception(exc)
    hint = SANDBOX_HINT if isinstance(exc, PermissionError) else ""
    where = _candidate_frame(exc)
    where = f" (at {where}; traceback in the job's log)" if where else ""
    return one_line(exc)[: 300 - len(hint) - len(where)] + where + hint


def _candidate_frame(exc: BaseException) -> str | None:
    """``file.py:line`` of the innermost frame of ``exc``'s traceback that is the
    candidate's code (outside kb_nano, the standard library and installed packages), or None."""
    import os
    import sys
    import sysconfig
    import traceback

    import kb_nano

    skip = {os.path.dirname(kb_nano.__file__), sys.prefix, sys.base_prefix}
    skip |= {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not any(f.filename.startswith(d) for d in skip)]
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else None
