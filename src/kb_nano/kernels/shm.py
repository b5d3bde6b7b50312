"""Tensors the judge shares with one worker, and only that worker.

CPU: the judge lays the tensors out in one anonymous ``memfd_create`` file, maps it, and
passes the file descriptor to the worker over the worker's own socket
(``SCM_RIGHTS``, :func:`multiprocessing.reduction.send_handle`), which maps it too. The
file has no name (nothing under ``/dev/shm`` to find), and no other process gets the
descriptor, so the baseline's slots are out of the candidate's reach. Its size is sealed
(``F_SEAL_SHRINK | F_SEAL_GROW``): no worker can truncate the judge's mapping away.
CUDA: the judge allocates the tensors on its device and sends them through the socket
pickled, which PyTorch turns into CUDA IPC handles (``torch.multiprocessing``); only the
receiving process gets the handles.

Only the judge sends pickles (the workers trust it); what a worker sends back is JSON
(:mod:`kb_nano.kernels.protocol`), never a pickle, and its tensors reach the judge only
as bytes written into these shared tensors.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from multiprocessing.reduction import recv_handle, send_handle

import torch

ALIGN = 256  # bytes: every tensor starts on a 256-byte boundary (CUDA / AVX-512 friendly)


def _layout(specs: list[tuple[list[int], torch.dtype]]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        end += -(-n // ALIGN) * ALIGN
    return offsets, max(end, ALIGN)


def _views(buf, specs, offsets) -> list[torch.Tensor]:
    out = []
    base = torch.frombuffer(buf, dtype=torch.uint8)
    for (shape, dtype), off in zip(specs, offsets):
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(base[off : off + n].view(dtype).view(shape))
    return out


class SharedTensors:
    """Tensors of the given ``(shape, dtype)`` specs, shared with one worker.

    ``device``: ``cpu`` (one memfd mapping) or a CUDA device (IPC). ``tensors`` are the
    judge's views; :meth:`send` hands them to a worker, which calls :func:`receive`.
    Raises ``OSError`` when the memfd cannot be created or mapped."""

    def __init__(self, specs: list[tuple[list[int], torch.dtype]], device: torch.device) -> None:
        self.specs = [(list(map(int, shape)), dtype) for shape, dtype in specs]
        self.device = device
        if device.type == "cuda":
            self.tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.specs]
            self._fd = None
            return
        self._offsets, self._size = _layout(self.specs)
        self._fd = os.memfd_create("kb_nano", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._fd, self._size)
        # its size sealed: a worker that reopens the file (/proc/self/map_files) and truncates
        # it would have the judge die of SIGBUS on its next access (and the next job's row with it)
        fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self._map = mmap.mmap(self._fd, self._size)
        self.tensors = _views(self._map, self.specs, self._offsets)

    def send(self, conn, pid: int, **fields) -> None:
        """Give the tensors to the worker at the other end of ``conn`` (process ``pid``),
        in a ``shared`` request that also carries ``fields``."""
        if self._fd is None:
            conn.send({**fields, "cmd": "shared", "cuda": self.tensors})
            return
        meta = [(shape, str(dtype).removeprefix("torch.")) for shape, dtype in self.specs]
        conn.send({**fields, "cmd": "shared", "size": self._size, "offsets": self._offsets, "specs": meta})
        send_handle(conn, self._fd, pid)

    def close(self) -> None:
        """Drop the judge's mapping (the memory goes once the worker drops its own)."""
        self.tensors = []
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def receive(conn, msg: dict) -> list[torch.Tensor]:
    """Worker side of :meth:`SharedTensors.send`: the tensors ``msg`` announces (CPU: the
    descriptor that follows it on ``conn`` is mapped; CUDA: already in ``msg``)."""
    if "cuda" in msg:
        return list(msg["cuda"])
    fd = recv_handle(conn)
    try:
        buf = mmap.mmap(fd, int(msg["size"]))
    finally:
        os.close(fd)
    specs = [(shape, getattr(torch, name)) for shape, name in msg["specs"]]
    return _views(buf, specs, msg["offsets"])
