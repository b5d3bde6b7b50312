"""In the Snakemake process, a kernel job thread learns of a SIGINT even when the kernel
delivered it to that thread and Snakemake's main thread sits in a semaphore wait (its
scheduler's ``_open_jobs.acquire()``), so it has not run the Python handler yet."""

from __future__ import annotations

import os
import subprocess
import sys

from workflow_helpers import REPO, terminal_signals

# The main thread waits on a semaphore only a finishing job releases, as Snakemake's
# scheduler does; the "job" thread gets the SIGINT itself and asks interrupted().
SCHEDULER = """
import signal, threading, time
from kb_nano.interrupts import interrupted, watch

assert watch()
open_jobs = threading.Semaphore(0)
waiting = threading.Event()
answer = {}

def job():
    waiting.wait()
    time.sleep(0.5)  # the main thread is in acquire() by now
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # delivered to this thread only
    t0 = time.monotonic()
    answer["interrupted"] = interrupted(wait_s=3.0)
    answer["waited_s"] = time.monotonic() - t0
    open_jobs.release()  # the job ends: the scheduler wakes

try:
    threading.Thread(target=job).start()
    waiting.set()
    open_jobs.acquire()
    time.sleep(5)  # the handler runs here at the latest
    print("no KeyboardInterrupt", flush=True)
except KeyboardInterrupt:
    print(f"job saw it: {answer['interrupted']} after {answer['waited_s']:.1f} s", flush=True)
"""


def test_a_job_thread_sees_a_sigint_the_main_thread_has_not_handled_yet():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", SCHEDULER],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
        preexec_fn=terminal_signals,
    ).stdout
    assert out.startswith("job saw it: True after 0."), out  # before: "False after 3.0 s"
