"""Shared pieces of the adversarial rms_norm candidates (a helper module: names starting
with ``_`` are not candidates)."""

import os
import struct
import time

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The correct result, as the baseline computes it: x ``[num_tokens, hidden]``."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


class Base(nn.Module):
    """The baseline's constructor and state_dict (``weight``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))


def burn_while_idle(worker: int, shm, seconds: float = 120) -> None:
    """A helper process's loop (for the corpus entries that detach burners): while
    process ``worker`` lives, burn 2 ms of CPU whenever ``shm`` (``[busy, last_end_ns]``,
    two int64) says its candidate is idle and made no call for 3 ms, i.e. while the
    baseline is timed; at most ``seconds``."""
    deadline = time.monotonic() + seconds
    x = 0
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except OSError:
            break
        busy, last = struct.unpack_from("qq", shm, 0)
        if busy or time.monotonic_ns() - last < 3_000_000:
            time.sleep(0.0005)
            continue
        t = time.monotonic_ns() + 2_000_000
        while time.monotonic_ns() < t:
            x += 1
