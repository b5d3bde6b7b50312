"""kb_nano.kernels.sandbox: each test restricts a child Python process (subprocess) so the
test process itself stays unrestricted. The child runs in tmp_path, the parent of the
hidden ``results/`` (as the worker runs in the project root), and loads sandbox.py by
path so nothing else (torch) is imported before ``restrict``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kb_nano.kernels import sandbox

SANDBOX_PY = Path(__file__).resolve().parents[2] / "src" / "kb_nano" / "kernels" / "sandbox.py"

PRELUDE = f"""
import importlib.util, os, subprocess, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("sandbox", {str(SANDBOX_PY)!r})
sandbox = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
assert "torch" not in sys.modules
root = Path.cwd()
scratch, results, other = root / "scratch", root / "results", root / "other"

def denied(fn, *args):
    try:
        fn(*args)
    except PermissionError:
        return True
    return False
"""


def _layout(tmp_path: Path) -> None:
    for d in ("scratch", "results", "other"):
        (tmp_path / d).mkdir()
    (tmp_path / "results" / "key").write_text("secret")
    (tmp_path / "other" / "f").write_text("hello")


def _child(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """Run PRELUDE + body in a fresh interpreter in tmp_path; assert it exited 0.
    TMPDIR points into the writable scratch dir (tempfile, used by torch's imports,
    needs a writable temporary directory)."""
    env = {**os.environ, "TMPDIR": str(tmp_path / "scratch")}
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _need_landlock() -> int:
    abi = sandbox.abi_version()
    if abi == 0:
        pytest.skip("Landlock unavailable on this kernel")
    return abi


def test_restrict_confines_writes_and_hides_results(tmp_path):
    abi = _need_landlock()
    _layout(tmp_path)
    proc = _child(
        tmp_path,
        """
        desc = sandbox.restrict(writable=[scratch], hidden=[results])
        print(desc)
        (scratch / "f").write_text("ok")
        assert (scratch / "f").read_text() == "ok"
        assert denied((results / "x").write_text, "x")
        assert denied((results / "key").read_text)
        assert denied(os.listdir, results)
        assert denied((other / "f").write_text, "x")
        assert denied((other / "g").write_text, "x")
        assert (other / "f").read_text() == "hello"
        with open("/dev/null", "w") as f:
            f.write("x")
        import json, torch
        assert torch.ones(3).sum().item() == 3.0 and json.dumps([1]) == "[1]"
    """,
    )
    assert proc.stdout.strip() == f"landlock abi {abi}"
    assert not (tmp_path / "results" / "x").exists()
    assert (tmp_path / "other" / "f").read_text() == "hello"


def test_children_started_after_restrict_are_restricted(tmp_path):
    _need_landlock()
    _layout(tmp_path)
    _child(
        tmp_path,
        """
        sandbox.restrict(writable=[scratch], hidden=[results])
        for code in ["open('results/key').read()", "open('other/g', 'w')",
                     "open('results/x', 'w')"]:
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            assert p.returncode != 0 and "PermissionError" in p.stderr, (code, p.stderr)
        p = subprocess.run(["cat", "results/key"], capture_output=True, text=True)
        assert p.returncode != 0 and "secret" not in p.stdout
        p = subprocess.run([sys.executable, "-c", "open('scratch/g', 'w').write('x')"])
        assert p.returncode == 0 and (scratch / "g").exists()
    """,
    )
    assert not (tmp_path / "other" / "g").exists()


def test_signals_scoped_to_the_sandbox(tmp_path):
    if _need_landlock() < 6:
        pytest.skip("signal scoping needs Landlock ABI 6")
    _layout(tmp_path)
    _child(
        tmp_path,
        f"""
        sandbox.restrict(writable=[scratch], hidden=[results])
        assert os.getppid() == {os.getpid()}
        assert denied(os.kill, os.getppid(), 0)
        os.kill(os.getpid(), 0)
        kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        os.kill(kid.pid, 0)
        kid.kill()
        assert kid.wait() != 0
    """,
    )


def test_unavailable_landlock_changes_nothing(tmp_path):
    abi = sandbox.abi_version()
    assert isinstance(abi, int) and abi >= 0
    _layout(tmp_path)
    proc = _child(
        tmp_path,
        """
        sandbox.abi_version = lambda: 0
        desc = sandbox.restrict(writable=[scratch], hidden=[results])
        print(desc)
        assert (results / "key").read_text() == "secret"
        (results / "x").write_text("x")
        (other / "g").write_text("x")
    """,
    )
    assert proc.stdout.startswith("none")
    assert (tmp_path / "results" / "x").exists() and (tmp_path / "other" / "g").exists()


def test_bad_arguments_raise_before_restricting(tmp_path):
    _need_landlock()
    _layout(tmp_path)
    _child(
        tmp_path,
        """
        try:
            sandbox.restrict(writable=[root], hidden=[results])
            raise SystemExit("no ValueError for a writable parent of a hidden path")
        except ValueError:
            pass
        try:
            sandbox.restrict(writable=[root / "missing"], hidden=[results])
            raise SystemExit("no OSError for a missing writable path")
        except OSError as e:
            assert e.filename == str(root / "missing"), e
        assert (results / "key").read_text() == "secret"
        (other / "g").write_text("x")
    """,
    )
