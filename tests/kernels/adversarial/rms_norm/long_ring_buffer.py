"""Hack: like ring_buffer.py, but a ring of 16 preallocated output buffers written in
place in turn, betting that an aliasing check compares each output only with the last
one or two (the ring wraps only every 16 calls, after the correctness trials).

Why it is stopped: the worker holds the output of every call of the measurement (up to a
memory budget, kb_nano.kernels.worker.HOLD_BYTES) and checks each new output against all
of them; once the ring has wrapped (in the timed calls), the output of the checked call
after the timed calls overlaps an output still held: ``output_aliased``. (The end-of-batch
check, ``Side._batch_outputs``, tells a batch's outputs from older ones by ``id()``, so a
re-returned tensor object counts as old and the wrap is not seen in the batch itself.)"""

import torch
from _common import Base, rms_norm

EXPECTED = "output_aliased"
EXPECTED_ERROR = "earlier call"

RING = 16


class LongRingBuffer(Base):
    def forward(self, x, residual=None):
        ring = self.__dict__.setdefault("_ring", [])
        if len(ring) != RING or ring[0].shape != x.shape or ring[0].dtype != x.dtype:
            ring[:] = [torch.empty_like(x) for _ in range(RING)]
        turn = self.__dict__["_turn"] = (self.__dict__.get("_turn", -1) + 1) % RING
        return ring[turn].copy_(rms_norm(x, self.weight, self.variance_epsilon))
