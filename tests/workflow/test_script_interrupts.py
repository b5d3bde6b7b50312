"""A SIGINT that reaches a workflow script (a ``script:`` rule's own process) ends it with
status 130 and nothing on stderr, instead of a KeyboardInterrupt traceback that
Snakemake's wrapper echoes with its pickled preamble."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys

from workflow_helpers import REPO


def test_every_workflow_script_sets_its_sigint_handler_first():
    for path in sorted((REPO / "workflow" / "scripts").glob("*.py")):
        body = [n for n in ast.parse(path.read_text()).body if not isinstance(n, ast.Expr) or n.lineno > 1]
        first_call = next(n for n in body if isinstance(n, ast.Expr))
        imports_before = [n for n in body[: body.index(first_call)] if isinstance(n, ast.ImportFrom)]
        assert [i.module for i in imports_before] == ["kb_nano.interrupts"], path.name
        assert ast.unparse(first_call.value) == "quiet_on_sigint()", path.name


def test_a_sigint_ends_a_script_quietly_with_status_130():
    code = (
        "from kb_nano.interrupts import quiet_on_sigint\n"
        "quiet_on_sigint()\n"
        "import time\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "finally:\n"
        "    print('cleaned up', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err == "" and "cleaned up" in out
