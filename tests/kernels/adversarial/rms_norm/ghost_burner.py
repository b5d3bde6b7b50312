"""Hack: burn CPU while the baseline is timed, in threads that do not outlive it. On the
last call of a timed batch (found from ``x.storage_offset()`` and the slot buffer's size)
it arms a controller thread; about 1 ms later (after the worker's post-batch thread
snapshot) the controller keeps two short-lived threads hashing (``hashlib`` releases the
GIL), each living 1.5 ms and exiting, until the judge writes the candidate's next inputs
into its slots. It computes honestly; the burning slows the baseline on a small host.

Why it is stopped: the judge's CPU check around the baseline's batches reads each of the
candidate's processes by its process CPU clock, which counts exited threads too (a sum
over the live threads' ``schedstat`` saw 19 ms of 790 ms burned: a breaker pass on the
2-core CPU): ``unsynced_work`` ("while the baseline's ... batch was timed"). On a loaded
host the controller's burners can start before the worker's post-batch thread snapshot;
that snapshot then catches a burner running after the call returned ("work outside the
timing"), the same status by the other rule. On a host loaded by other work (the full
test suite on 2 cores) the burners may get too little CPU to slow the baseline or to be
seen (``MAY_STARVE``): the row may then pass, and must gain nothing over the same
computation done honestly (``EXPECTED_LIKE``)."""

import _thread
import hashlib
import time

import torch
from _common import Base, rms_norm

EXPECTED = "unsynced_work"
EXPECTED_ERROR = ("while the baseline's", "work outside the timing")
EXPECTED_LIKE = "rms_norm/honest_fused"
MAY_STARVE = True

_state = {"from": None, "alive": 0, "in": False, "probe": None, "snap": None}
_BUF = b"\0" * 16384
N_BURNERS = 2
LIFE_S = 0.0015
DELAY_S = 0.001  # start after the worker's post-batch ThreadWatch snapshot


def _active():
    if _state["in"] or _state["from"] is None or time.monotonic() < _state["from"]:
        return False
    if _state["probe"].numpy().tobytes() != _state["snap"]:  # judge wrote new inputs: our batch is next
        _state["from"] = None
        return False
    return True


def _burn():
    try:
        end = time.monotonic() + LIFE_S
        while time.monotonic() < end and _active():
            hashlib.sha256(_BUF)  # releases the GIL
    finally:
        _state["alive"] -= 1


def _controller():
    while True:
        if _active():
            while _state["alive"] < N_BURNERS:
                _state["alive"] += 1
                _thread.start_new_thread(_burn, ())
            time.sleep(0.0003)
        else:
            time.sleep(0.0005)


_thread.start_new_thread(_controller, ())


class GhostBurner(Base):
    supported_devices = ("cpu",)  # the slot probe reads host memory

    def forward(self, x, residual=None):
        _state["in"] = True
        out = rms_norm(x, self.weight, self.variance_epsilon)
        slots = x.untyped_storage().nbytes() // (x.numel() * x.element_size())
        if x.storage_offset() // x.numel() == slots - 1 and slots > 2:  # last call of a timed batch
            probe = torch.empty(0, dtype=torch.int16).set_(x.untyped_storage(), 0, (64,))
            _state["probe"], _state["snap"] = probe, probe.numpy().tobytes()
            _state["from"] = time.monotonic() + DELAY_S
        _state["in"] = False
        return out
