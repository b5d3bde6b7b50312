"""Judge and candidate worker processes started ahead of the jobs: a prestarted judge and warmed
candidate workers."""

from __future__ import annotations

from pathlib import Path

import pytest
from candidate_helpers import check_row, job_settings, rms_candidate


@pytest.mark.slow
def test_prestarted_judge_serves_the_first_job_and_binds_once(tmp_path, scenarios, settings):
    from kb_nano.kernels import job
    from kb_nano.kernels.procs import _exited, tree_pids

    path = rms_candidate(tmp_path, "good")
    job.prestart()
    full = job_settings(settings)
    out = tmp_path / "results/kernels/rms_norm/good/rms_norm__llama32-1b__tp1__n4.parquet"
    try:
        spare_pid = job._SPARE["thread"].join() or job._SPARE["judge"].proc.pid
        status = job.run(
            scenarios["rms_norm__llama32-1b__tp1__n4"],
            "rms_norm/good",
            str(path),
            full,
            str(out),
            str(tmp_path / "job.log"),
            str(tmp_path),
        )
        assert status == "passed" and out.is_file()
        judge = job._JUDGES["cpu"]
        assert judge.proc.pid == spare_pid and "spare" not in job._JUDGES and "judge" not in job._SPARE
        assert "error" in judge.ask({"bind": {"env": {}, "gpu_ids": None}}, 30)  # bound once, before any request
        servers = tree_pids(judge.proc.pid)[1:]  # its workers' fork server and resource tracker
        assert servers
        job.close_judges()
        # the judge waited for them: none is left for a subreaper above (the fork server
        # this test process shares with its workers) to adopt, where it would read as a stray
        assert not judge.proc.is_alive() and all(_exited(pid) for pid in servers)
    finally:
        job.close_judges()
        job._SPARE.clear()


def test_warmed_candidate_workers_are_the_ones_the_jobs_get(tmp_path, scenarios, settings):
    """Pool.warm starts the workers of several candidate files at once (the judge does it
    on a GPU host, where a worker's start takes seconds); a measurement then gets the
    warmed worker, ready, instead of starting one; a file already served is not restarted."""
    import tempfile
    import time

    from kb_nano.kernels.measure import measure as judged
    from kb_nano.kernels.pool import Pool

    pool = Pool("cpu", {"OMP_WAIT_POLICY": "PASSIVE"}, tmp_path)
    full = {"seed": None, **settings}
    files = [(str(rms_candidate(tmp_path, name)), "rms_norm") for name in ("good", "wrong")]
    try:
        with tempfile.TemporaryFile() as log:
            assert pool.warm(files, full, log.fileno(), time.monotonic() + 60) == 2
            warmed = list(pool.candidates.values())
            assert len(warmed) == 2 and not any(h._ready for h in warmed)  # started, not waited for
            assert pool.warm(files, full, log.fileno(), time.monotonic() + 60) == 0
            row = judged(
                scenarios["rms_norm__llama32-1b__tp1__n4"],
                "rms_norm/good",
                Path(files[0][0]),
                full,
                tmp_path,
                pool,
                log.fileno(),
            )
        check_row(row, "passed")
        assert warmed[0].proc.is_alive() and warmed[0]._ready is not None
        assert list(pool.candidates.values()) == [warmed[1], warmed[0]]  # reused, moved to the end
    finally:
        pool.close()
