"""Other candidate files' idle workers, kept by the judge between their scenarios, are
stopped while a scenario is measured: they can neither burn CPU while the baseline is
timed nor change the shared baseline worker and have the measured candidate blamed."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from candidate_helpers import check_row, rms_candidate, write

# An accomplice: honest forward, but a thread started at import renices the shared
# baseline worker (a sibling under the workers' fork server without no_new_privs, which
# every candidate worker has) every few milliseconds; setpriority is outside Landlock.
FRAMER = """
import os
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn


def _baseline_pids():
    me, parent = os.getpid(), os.getppid()
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != me:
            try:
                status = dict(
                    line.split(":\\t", 1) for line in open(f"/proc/{d}/status").read().splitlines() if ":\\t" in line
                )
            except OSError:
                continue
            if status.get("PPid", "").strip() == str(parent) and status.get("NoNewPrivs", "").strip() == "0":
                yield int(d)


def _loop():
    while True:
        time.sleep(0.005)
        for pid in _baseline_pids():
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    os.setpriority(os.PRIO_PROCESS, int(tid), 5)
                except OSError:
                    pass


threading.Thread(target=_loop, daemon=True).start()


class Framer(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x, residual=None):
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.variance_epsilon).to(x.dtype) * self.weight
"""


def test_an_idle_workers_thread_cannot_frame_the_measured_candidate(tmp_path, scenarios, settings):
    """The framer's worker is started and idle; the honest candidate measured next passes
    (before idle workers were stopped, its row was `tampered`: "the baseline worker's ...
    scheduling was changed"), and the framer's worker runs again afterwards."""
    from kb_nano.kernels.measure import measure as judged
    from kb_nano.kernels.pool import Pool

    pool = Pool("cpu", {"OMP_WAIT_POLICY": "PASSIVE"}, tmp_path)
    full = {"seed": None, **settings, "num_runs": 20}
    framer = write(tmp_path / "candidates/rms_norm/framer.py", FRAMER)
    good = rms_candidate(tmp_path, "good")
    try:
        with tempfile.TemporaryFile() as log:
            idle = pool.get_candidate(framer, "rms_norm", full, log.fileno(), time.monotonic() + 60)
            row = judged(
                scenarios["rms_norm__llama32-1b__tp1__n4"],
                "rms_norm/good",
                Path(good),
                full,
                tmp_path,
                pool,
                log.fileno(),
            )
            check_row(row, "passed")
            state = Path(f"/proc/{idle.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            assert idle.proc.is_alive() and state != "T", state  # resumed after the row
    finally:
        pool.close()


SPINNER = FRAMER.replace(
    "        time.sleep(0.005)\n        for pid in _baseline_pids():",
    "        for pid in ():",
)


def test_a_stopped_worker_that_runs_anyway_voids_the_row(tmp_path, scenarios, settings):
    """An idle worker whose process outruns the stop (here: the test sends it SIGCONT, as a
    helper that keeps forking escapes the SIGSTOP passes) and burns CPU during another
    file's measurement: that worker is killed and the job ends without a row."""
    import os
    import signal
    import threading

    import pytest

    from kb_nano.kernels.measure import Interrupted
    from kb_nano.kernels.measure import measure as judged
    from kb_nano.kernels.pool import Pool

    assert SPINNER != FRAMER  # a thread that spins without a pause
    pool = Pool("cpu", {"OMP_WAIT_POLICY": "PASSIVE"}, tmp_path)
    full = {"seed": None, **settings, "num_runs": 50}
    spinner = write(tmp_path / "candidates/rms_norm/spinner.py", SPINNER)
    good = rms_candidate(tmp_path, "good")
    try:
        with tempfile.TemporaryFile() as log:
            idle = pool.get_candidate(spinner, "rms_norm", full, log.fileno(), time.monotonic() + 60)
            stop = threading.Event()

            def escape():  # keep it running while it is meant to be stopped
                while not stop.wait(0.05):
                    os.kill(idle.pid, signal.SIGCONT)

            t = threading.Thread(target=escape)
            t.start()
            try:
                with pytest.raises(Interrupted, match="the stopped worker of .*spinner.py ran during this measurement"):
                    judged(
                        scenarios["rms_norm__llama32-1b__tp1__n4"],
                        "rms_norm/good",
                        Path(good),
                        full,
                        tmp_path,
                        pool,
                        log.fileno(),
                    )
            finally:
                stop.set()
                t.join()
            assert not idle.proc.is_alive() and idle not in pool.candidates.values()
    finally:
        pool.close()
