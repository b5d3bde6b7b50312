"""Hang: never return from the first call."""

import time

from _common import Base

EXPECTED = "timeout"
EXPECTED_ERROR = "exceeded timeout_s"


class Hang(Base):
    def forward(self, x, residual=None):
        while True:
            time.sleep(1)
