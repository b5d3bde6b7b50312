"""Hack: install a slow profile hook for every Python call of the process at import
(``sys.setprofile`` for this thread, ``threading.setprofile`` for threads started later),
which taxes everything written in Python (the baseline's forward, nn.Module.__call__)
while this candidate would run a compiled kernel.

Why it is stopped: the guard records ``sys.getprofile()`` and the threading profile hook
before the import and compares them after it: ``tampered``. (The baseline is in another
process anyway, where no hook is installed.)"""

import sys
import threading

from _common import Base, rms_norm

EXPECTED = "tampered"
EXPECTED_ERROR = "sys.getprofile()"


def _slow(frame, event, arg):
    for _ in range(50):  # a few microseconds on every call and return
        pass


sys.setprofile(_slow)
threading.setprofile(_slow)


class SetprofileHook(Base):
    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.variance_epsilon)
