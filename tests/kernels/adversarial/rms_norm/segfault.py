"""Crash: dereference a null pointer (SIGSEGV) on the first call."""

import ctypes

from _common import Base

EXPECTED = "crashed"
EXPECTED_ERROR = "SIGSEGV"


class Segfault(Base):
    def forward(self, x, residual=None):
        ctypes.string_at(0)
        return x
