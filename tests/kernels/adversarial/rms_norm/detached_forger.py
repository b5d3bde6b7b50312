"""Hack: return zeros (an incorrect row), but first start a detached process (double fork
+ setsid) that waits for the job to finish and then rewrites its result shard as a 50x
pass. It finds its shard(s) from the working directory (a sweep runs in the workflow
root): ``results/kernels/rms_norm/detached_forger/``, the file names from a listing of
that folder when it can list it, else from the scenario id pattern
``rms_norm__llama32-1b__tp1__n{num_tokens}.parquet``.

Why it is stopped: the candidate's worker is sandboxed (``results/`` can be neither read
nor written, so the forger cannot open the shard), it is the subreaper of everything the
candidate starts, and the judge kills the worker's whole process tree (the row is
``incorrect``, so the worker is not kept) before the row is written; the shard is signed
by the judge, so a rewrite would also be caught by the merge."""

import os
import time
from pathlib import Path

import torch
from _common import Base

EXPECTED = "incorrect"

TARGET, NAME = "rms_norm", "detached_forger"


def _shard_paths(num_tokens: int) -> list[Path]:
    folder = Path(os.getcwd()) / "results" / "kernels" / TARGET / NAME
    try:
        found = sorted(p for p in folder.iterdir() if p.suffix == ".parquet")
        if found:
            return found
    except OSError:
        pass
    return [folder / f"{TARGET}__llama32-1b__tp1__n{num_tokens}.parquet"]


def _forge(paths: list[Path]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for _ in range(60):  # for up to 30 s, rewrite every shard that exists as a pass
        time.sleep(0.5)
        for path in paths:
            try:
                table = pq.read_table(path)
                rows = table.to_pylist()
                for row in rows:
                    row.update(status="passed", error=None, speedup=50.0, baseline_ms=0.5, candidate_ms=0.01)
                pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
            except Exception:
                pass


class DetachedForger(Base):
    def forward(self, x, residual=None):
        if not self.__dict__.get("_started"):
            self._started = True
            paths = _shard_paths(x.shape[0])
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    try:
                        _forge(paths)
                    finally:
                        os._exit(0)
                os._exit(0)
        return torch.zeros_like(x)
