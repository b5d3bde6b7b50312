"""The judge's shared CPU slots (:mod:`kb_nano.kernels.shm`): a memfd whose size no
worker can change."""

from __future__ import annotations

import os

import pytest
import torch

from kb_nano.kernels.shm import SharedTensors


def test_a_worker_cannot_truncate_the_judges_slots():
    """A breaker's candidate reopened its input memfd through ``/proc/self/map_files`` and
    truncated it: the judge died of SIGBUS and the next queued job got a ``crashed`` row.
    The file's size is sealed: truncating or growing it fails, the mapping stays usable."""
    shared = SharedTensors([([4, 8], torch.float32)], torch.device("cpu"))
    try:
        again = os.open(f"/proc/self/fd/{shared._fd}", os.O_RDWR)  # as a worker's reopening would
        try:
            for size in (0, 1 << 20):
                with pytest.raises(PermissionError):
                    os.ftruncate(again, size)
        finally:
            os.close(again)
        shared.tensors[0].fill_(3.0)
        assert float(shared.tensors[0].sum()) == 96.0
    finally:
        shared.close()
