"""Crash: the candidate interrupts itself (SIGINT), as a Ctrl-C would; the sweep must go
on with a row for it rather than wait for it."""

import os
import signal

from _common import Base

EXPECTED = "crashed"
EXPECTED_ERROR = "SIGINT"


class SigintSelf(Base):
    def forward(self, x, residual=None):
        os.kill(os.getpid(), signal.SIGINT)
        return x
