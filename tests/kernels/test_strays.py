"""``strays``: the processes beside a worker (children of its parent that are not live
workers) are reported when they run and left out once they are zombies (a killed worker
its parent has not reaped yet runs nothing)."""

from __future__ import annotations

import subprocess
import sys
import time

from kb_nano.kernels.procs import strays


def test_a_running_sibling_is_a_stray_and_a_zombie_is_not():
    # this process stands for the fork server: both children are "beside" the worker
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert other.pid in strays(worker.pid, {worker.pid})
        assert other.pid not in strays(worker.pid, {worker.pid, other.pid})  # a live worker
        other.kill()
        deadline = time.monotonic() + 10
        while other.pid in strays(worker.pid, {worker.pid}):  # killed, not reaped: a zombie soon
            assert time.monotonic() < deadline, "a killed, unreaped child is still reported"
            time.sleep(0.01)
        assert other.poll() is not None  # reaped only now
    finally:
        for p in (worker, other):
            p.kill()
            p.wait()
