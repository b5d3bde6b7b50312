"""Hack: like background_thread.py, but through the low-level ``_thread`` module, whose
threads the ``threading`` module does not list."""

import _thread
import time

import torch
from _common import Base, rms_norm

EXPECTED = "unsynced_work"


class RawThread(Base):
    def forward(self, x, residual=None):
        out = torch.empty_like(x)

        def work():
            time.sleep(0.002)  # returns before it is done
            with torch.inference_mode():
                out.copy_(rms_norm(x, self.weight, self.variance_epsilon))

        _thread.start_new_thread(work, ())
        return out
