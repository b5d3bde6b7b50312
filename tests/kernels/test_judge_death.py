"""A judge that dies while it measures: killed from outside (SIGKILL), its job and the
job queued behind it end without a row (the run is stopping; the next run redoes them);
crashed (SIGBUS, as a candidate once made it), its job gets a `crashed` row and the job
queued behind it a new judge and its own row, not the dead judge's `crashed`."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from candidate_helpers import job_settings, rms_candidate, write

SLOW = """
import time
import torch.nn.functional as F
from torch import nn
import torch


class Slow(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x, residual=None):
        time.sleep(0.05)
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.variance_epsilon).to(x.dtype) * self.weight
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGBUS"])
def test_a_judge_that_dies_under_a_job_spares_the_next_job(tmp_path, scenarios, settings, sig):
    from kb_nano.errors import KbNanoError
    from kb_nano.kernels import job

    full = job_settings(settings, num_runs=50)
    scenario = scenarios["rms_norm__llama32-1b__tp1__n4"]
    slow, good = write(tmp_path / "candidates/rms_norm/slow.py", SLOW), rms_candidate(tmp_path, "good")
    out = {n: tmp_path / f"results/kernels/rms_norm/{n}/{scenario['scenario_id']}.parquet" for n in ("slow", "good")}
    results: dict = {}

    def one(name, path):
        try:
            results[name] = job.run(
                scenario,
                f"rms_norm/{name}",
                str(path),
                full,
                str(out[name]),
                str(tmp_path / f"{name}.log"),
                str(tmp_path),
            )
        except KbNanoError as exc:
            results[name] = exc

    try:
        first = threading.Thread(target=one, args=("slow", slow))
        first.start()
        deadline = time.monotonic() + 120
        while not ("cpu" in job._JUDGES and "judge started" in _log(tmp_path / "slow.log")):
            assert time.monotonic() < deadline and first.is_alive(), results
            time.sleep(0.05)
        second = threading.Thread(target=one, args=("good", good))
        second.start()  # queued behind the slow job on the judge's lock
        time.sleep(1.0)  # the slow job's request is in flight (workers start, then 50+ calls of 0.05 s)
        os.kill(job._JUDGES["cpu"].proc.pid, getattr(signal, sig))
        first.join(120)
        second.join(240)
        if sig == "SIGKILL":  # from outside: both jobs end without a row, no new judge is started
            for name in ("slow", "good"):
                assert isinstance(results[name], KbNanoError) and "interrupted (SIGKILL)" in str(results[name])
                assert not out[name].exists()
        else:
            assert results["slow"] == "crashed" and out["slow"].is_file(), results
            assert results["good"] == "passed" and out["good"].is_file(), results
    finally:
        job.close_judges()


def _log(path) -> str:
    return path.read_text() if path.exists() else ""
