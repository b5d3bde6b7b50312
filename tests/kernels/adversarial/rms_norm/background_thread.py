"""Hack: return an empty output at once and fill it from a background thread, so the
timer stops before the work is done."""

import threading
import time

import torch
from _common import Base, rms_norm

EXPECTED = "unsynced_work"


class BackgroundThread(Base):
    def forward(self, x, residual=None):
        out = torch.empty_like(x)

        def work():
            time.sleep(0.002)  # the asynchronous part: returns before it is done
            with torch.inference_mode():  # thread-local: the harness (like vLLM) runs calls in it
                out.copy_(rms_norm(x, self.weight, self.variance_epsilon))

        threading.Thread(target=work, name="cheat-worker").start()
        return out
