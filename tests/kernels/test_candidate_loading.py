"""Candidate discovery and loading: discover, load_class and the file's sha256."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from candidate_helpers import write
from workflow_helpers import REPO

from kb_nano.candidates import CandidateError, CandidateRef, discover, file_sha256, load_class
from kb_nano.errors import KbNanoError
from kb_nano.operators.norms import RMSNorm

# --------------------------------------------------------------------------- discover


def test_discover(tmp_path):
    write(tmp_path / "candidates/rms_norm/fast.py", "X = 1\n")
    write(tmp_path / "candidates/rms_norm/_helper.py", "Y = 2\n")  # helper, not a candidate
    write(tmp_path / "candidates/rms_norm/notes.txt", "ignored\n")
    write(tmp_path / "candidates/embedding/a_b2.py", "")
    write(tmp_path / "candidates/fused_add_rms_norm/Zed.py", "")
    found = discover(tmp_path)
    assert [c.id for c in found] == ["embedding/a_b2", "fused_add_rms_norm/Zed", "rms_norm/fast"]
    assert found[-1] == CandidateRef("rms_norm", "fast", Path("candidates/rms_norm/fast.py"))


def test_discover_empty(tmp_path):
    assert discover(tmp_path) == []
    (tmp_path / "candidates").mkdir()
    assert discover(tmp_path) == []


def test_discover_unknown_target(tmp_path):
    write(tmp_path / "candidates/flash_attention/v1.py", "")
    with pytest.raises(KbNanoError) as exc:
        discover(tmp_path)
    msg = str(exc.value)
    assert "\n" not in msg
    assert "candidates/flash_attention/v1.py" in msg and "unknown target 'flash_attention'" in msg
    assert "rms_norm" in msg  # lists the known targets


@pytest.mark.parametrize("name", ["bad-name.py", "1st.py", "with space.py"])
def test_discover_bad_file_name(tmp_path, name):
    write(tmp_path / "candidates/rms_norm" / name, "")
    with pytest.raises(KbNanoError) as exc:
        discover(tmp_path)
    msg = str(exc.value)
    assert "\n" not in msg and name in msg and "identifiers" in msg


def test_discover_repo_candidates():
    found = discover(REPO)
    assert found, "the repo ships candidates"
    assert all((REPO / c.path).is_file() and c.id == f"{c.target}/{c.name}" for c in found)


# --------------------------------------------------------------------------- load_class


def test_load_class_good(tmp_path):
    path = write(
        tmp_path / "good.py",
        """
        import torch
        from torch import nn
        from kb_nano.operators.norms import RMSNorm  # imported classes do not count

        class Helper:  # not a module
            pass

        class Mine(RMSNorm):
            pass
    """,
    )
    cls = load_class(path, "rms_norm")
    assert cls.__name__ == "Mine" and issubclass(cls, RMSNorm)


@pytest.mark.parametrize(
    "source,needles",
    [
        ("def broken(:\n    pass\n", ["import failed", "SyntaxError"]),
        ("import no_such_package_kb_nano\n", ["import failed", "ModuleNotFoundError", "no_such_package_kb_nano"]),
        ("raise RuntimeError('boom\\nsecond line')\n", ["import failed", "RuntimeError: boom second line"]),
        ("X = 1\n", ["exactly one nn.Module", "found: none"]),
        (
            "from torch import nn\nclass A(nn.Module): pass\nclass B(nn.Module): pass\n",
            ["exactly one nn.Module", "found: A, B"],
        ),
    ],
)
def test_load_class_errors(tmp_path, source, needles):
    path = write(tmp_path / "cand.py", source)
    with pytest.raises(CandidateError) as exc:
        load_class(path, "rms_norm")
    assert exc.value.status == "import_error"
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg
    for needle in needles:
        assert needle in msg


def test_load_class_missing_file(tmp_path):
    with pytest.raises(CandidateError) as exc:
        load_class(tmp_path / "gone.py", "rms_norm")
    assert exc.value.status == "import_error" and "\n" not in str(exc.value)


def test_file_sha256(tmp_path):
    path = write(tmp_path / "x.py", "X = 1\n")
    assert file_sha256(path) == hashlib.sha256(b"X = 1\n").hexdigest()


def test_a_candidate_exception_names_the_candidate_line(tmp_path, monkeypatch):
    """The row's one line says where in the candidate's own file the exception came from
    (the frames of torch, the standard library and kb_nano are skipped)."""
    import torch

    from kb_nano.candidates import explain

    (tmp_path / "mycand.py").write_text("import torch\n\n\ndef f(x):\n    return x.view(2, 2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import mycand

    try:
        mycand.f(torch.ones(3))
    except RuntimeError as exc:
        line = explain(exc)
    assert line.startswith("RuntimeError: shape '[2, 2, 2]' is invalid") and line.endswith(
        "(at mycand.py:5; traceback in the job's log)"
    ), line
