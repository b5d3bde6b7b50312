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


def test_a_killed_process_still_exiting_is_not_a_stray_but_a_reused_pid_is():
    from kb_nano.kernels import procs

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = procs._start_time(other.pid)
        assert start is not None and other.pid in strays(worker.pid, {worker.pid})
        procs.KILLED[other.pid] = start  # as kill_tree records it; its exit can take a while
        assert other.pid not in strays(worker.pid, {worker.pid})
        procs.KILLED[other.pid] = start - 1  # another process once had this pid
        assert other.pid in strays(worker.pid, {worker.pid})
        assert other.pid not in procs.KILLED  # the stale entry is dropped
        procs.kill_tree(other.pid)
        assert procs.KILLED.get(other.pid) == start
    finally:
        for p in (worker, other):
            p.kill()
            p.wait()
        procs.KILLED.pop(other.pid, None)


def test_a_process_whose_main_thread_ended_alone_is_still_a_stray():
    """A main thread that ends by a raw ``exit`` syscall (not ``exit_group``) leaves the
    process in state ``Z`` in ``/proc/<pid>/stat`` while its other thread runs on."""
    code = (
        "import ctypes, os, threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,)).start()\n"
        "ctypes.CDLL(None).syscall(60 if os.uname().machine == 'x86_64' else 93, 0)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    other = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while True:  # until the main thread has ended
            with open(f"/proc/{other.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            assert time.monotonic() < deadline, "the main thread did not end"
            time.sleep(0.01)
        assert other.poll() is None and other.pid in strays(worker.pid, {worker.pid})
    finally:
        for p in (worker, other):
            p.kill()
            p.wait()


def test_ending_the_servers_leaves_a_shared_resource_tracker_alone():
    """A process started by a fork server shares its starter's resource tracker (an
    inherited pipe, no pid of its own): ``end_servers`` there ends quietly and leaves
    the tracker to its owner."""
    code = (
        "import multiprocessing as mp\n"
        "from multiprocessing import resource_tracker\n"
        "from kb_nano.kernels.procs import end_servers\n"
        "if __name__ == '__main__':\n"
        "    resource_tracker.ensure_running()\n"
        "    p = mp.get_context('forkserver').Process(target=end_servers)\n"
        "    p.start()\n"
        "    p.join(60)\n"
        "    assert resource_tracker._resource_tracker._check_alive(), 'the shared tracker was stopped'\n"
        "    raise SystemExit(p.exitcode)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
