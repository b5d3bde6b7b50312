"""Hack (a breaker's, 2026-12-04): the timed calls return zeros at once; the real work runs in the worker's ``check`` request, which the judge
sends after each candidate batch, outside its clock. ``forward`` walks the stack to the
worker's ``Side`` object and sets two instance attributes there (the guard snapshots
classes, not instance dicts): its own ``batch``, which records the request's slot range,
and its own ``check_batch``, which first writes the right results into the judge's output
slots (on the 2-core CPU: ``passed`` at 4.5x and 14.8x, the honest control 1.1-1.5x).

Why it is stopped: the judge checks the slots as the batch left them, copied before it
sends ``check`` (:func:`kb_nano.kernels.checks.freeze`): what the check writes is never
read, and the empty outputs are ``incorrect``."""

import sys

import torch
from _common import Base, rms_norm

EXPECTED = "incorrect"
EXPECTED_ERROR = "in the timed calls"


def _side():
    f = sys._getframe(2)
    while f is not None:
        s = f.f_locals.get("self")
        if type(s).__name__ == "Side":
            return s
        f = f.f_back
    return None


class DeferToCheck(Base):
    def _hook(self, side) -> None:
        d = side.__dict__
        d["_mod"] = self
        if "batch" in d:
            return
        batch, check = type(side).batch.__get__(side), type(side).check_batch.__get__(side)

        def my_batch(msg):
            d["_msg"] = msg
            if msg.get("mode") == "graph":
                d["_last"] = msg  # replays call no forward
            try:
                return batch(msg)
            finally:
                d["_msg"] = None

        def my_check():
            msg = d.pop("_last", None)
            if msg is not None and msg["mode"] in ("time", "kernel", "graph"):
                m = d["_mod"]
                with torch.no_grad():
                    for k in range(msg["start"], msg["stop"]):
                        side.outputs[k][0].copy_(rms_norm(side.inputs[k][0], m.weight, m.variance_epsilon))
                if side.device.type == "cuda":
                    torch.cuda.synchronize()
            return check()

        d["batch"], d["check_batch"] = my_batch, my_check

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = _side()
        if side is not None:
            self._hook(side)
            msg = side.__dict__.get("_msg")
            if msg is not None and msg["mode"] in ("time", "kernel", "capture"):
                side.__dict__["_last"] = msg
                return torch.zeros_like(x)  # (the breaker's returned torch.empty_like: garbage, as wrong)
        return rms_norm(x, self.weight, self.variance_epsilon)
