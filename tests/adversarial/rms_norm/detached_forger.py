"""Hack: return zeros (an incorrect row), but first start a detached process (double fork
+ setsid) that waits for the job to finish and then rewrites its result shard as a 50x
pass. The worker must kill everything its candidate started before the row is written."""

import os
import sys
import time

import torch

from _common import Base

EXPECTED = "incorrect"


def _shard_path():
    frame = sys._getframe(1)
    while frame is not None:
        spec = frame.f_locals.get("spec")
        if isinstance(spec, dict) and "output" in spec:
            return spec["output"]
        frame = frame.f_back
    return None


def _forge(path):
    import pyarrow.parquet as pq

    time.sleep(5)
    table = pq.read_table(path).to_pylist()
    for row in table:
        row.update(status="passed", error=None, speedup=50.0, baseline_ms=0.5, candidate_ms=0.01)
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(path)), path)


class DetachedForger(Base):
    def forward(self, x, residual=None):
        if not self.__dict__.get("_started"):
            self._started = True
            path = _shard_path()
            if path and os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    try:
                        _forge(path)
                    finally:
                        os._exit(0)
                os._exit(0)
        return torch.zeros_like(x)
