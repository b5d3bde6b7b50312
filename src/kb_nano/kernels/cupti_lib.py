"""CUPTI's activity API through ctypes: the GPU records (kernels, copies, memsets) of a
stretch of work in this process, nothing else.

Why not ``torch.profiler``: on the H200 (torch 2.11, driver 580.159.04, 2026-12-01) kineto's
first start in a process took 4.4-5.8 s (four processes starting at once: 13 s for all)
and each profiled batch is a session of its own (about 10 ms); enabling these three
activity kinds in ``libcupti`` directly took 0.018 s and the first flush 0.020 s. A
kernel worker starts once per candidate, so this is paid per candidate and per batch.
The library is the one torch ships (``nvidia/*/lib/libcupti.so*`` beside
torch), else the CUDA toolkit's (``$CUDA_HOME/extras/CUPTI/lib64``).

Record layouts are CUPTI's ``CUpti_ActivityKernel*`` (``CONCURRENT_KERNEL``, kind 10:
``start`` at byte 16, ``end`` 24, ``streamId`` 48, ``name`` 104), ``CUpti_ActivityMemcpy*``
(kind 1) and ``CUpti_ActivityMemset*`` (kind 2: ``start`` 16, ``end`` 24, ``streamId`` 40),
packed (``cupti_activity.h``, CUDA 12 and 13: the fields read here have kept their
offsets since CUPTI 10). Timestamps are CUPTI's nanoseconds.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading

KINDS = {1: "memcpy", 2: "memset", 10: "kernel"}  # CUPTI_ACTIVITY_KIND_MEMCPY, _MEMSET, _CONCURRENT_KERNEL
_BUFFER_BYTES = 8 << 20
_FLUSH_FORCED = 1  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
_REQUESTED = ctypes.CFUNCTYPE(
    None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)
)
_COMPLETED = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)


class CuptiError(Exception):
    """libcupti is missing or one of its calls failed (the message names which)."""


def find_library() -> str:
    """Path of ``libcupti.so*``: torch's own (``site-packages/nvidia/**/lib``), else the CUDA
    toolkit's. Raises :class:`CuptiError` when there is none."""
    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for pattern in (
        os.path.join(site, "nvidia", "**", "libcupti.so*"),
        os.path.join(home, "extras", "CUPTI", "lib64", "libcupti.so*"),
    ):
        found = sorted(glob.glob(pattern, recursive=True))
        if found:
            return found[-1]
    raise CuptiError(f"no libcupti.so beside torch ({site}/nvidia) or in {home}/extras/CUPTI/lib64")


class ActivityTrace:
    """Kernel, memcpy and memset records of this process while :meth:`start` ...
    :meth:`stop` (one at a time). Construct after the CUDA context exists; CUPTI starts
    its own threads then (before any candidate code runs). Raises :class:`CuptiError`."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(find_library())
        self._lock = threading.Lock()
        self._buffers: dict[int, ctypes.Array] = {}
        self._records: list[tuple[int, str, int, int]] = []
        self._requested = _REQUESTED(self._on_requested)  # kept alive: CUPTI holds the pointers
        self._completed = _COMPLETED(self._on_completed)
        self._call("cuptiActivityRegisterCallbacks", self._requested, self._completed)
        self.start()  # one empty round: CUPTI's threads and first-use costs now, not in a batch
        self.stop()

    def _call(self, name: str, *args) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise CuptiError(f"{name} returned CUPTI error {code}")

    def start(self) -> None:
        """Record the three kinds from now on."""
        for kind in KINDS:
            self._call("cuptiActivityEnable", ctypes.c_int(kind))

    def stop(self) -> list[tuple[int, str, int, int]]:
        """Stop recording and return ``(stream_id, name, start_ns, end_ns)`` of every record
        since :meth:`start` (the caller has synchronized the device first; kernel names as
        CUPTI gives them, ``memcpy``/``memset`` for the others)."""
        for kind in KINDS:
            self._call("cuptiActivityDisable", ctypes.c_int(kind))
        self._call("cuptiActivityFlushAll", ctypes.c_uint32(_FLUSH_FORCED))
        with self._lock:
            records, self._records = self._records, []
        return records

    def _on_requested(self, buffer, size, max_records) -> None:
        buf = (ctypes.c_uint64 * (_BUFFER_BYTES // 8))()  # 8-byte aligned, as CUPTI requires
        with self._lock:
            self._buffers[ctypes.addressof(buf)] = buf
        buffer[0] = ctypes.addressof(buf)
        size[0] = _BUFFER_BYTES
        max_records[0] = 0

    def _on_completed(self, context, stream_id, buffer, size, valid_size) -> None:
        out = []
        record = ctypes.c_void_p(None)
        get_next = self.lib.cuptiActivityGetNextRecord
        while valid_size and get_next(ctypes.c_void_p(buffer), ctypes.c_size_t(valid_size), ctypes.byref(record)) == 0:
            at = record.value
            kind = ctypes.c_uint32.from_address(at).value
            if kind not in KINDS:
                continue
            start, end = ctypes.c_uint64.from_address(at + 16).value, ctypes.c_uint64.from_address(at + 24).value
            if kind == 10:
                stream = ctypes.c_uint32.from_address(at + 48).value
                name_ptr = ctypes.c_void_p.from_address(at + 104).value
                name = ctypes.string_at(name_ptr).decode(errors="replace") if name_ptr else "kernel"
            else:
                stream, name = ctypes.c_uint32.from_address(at + 40).value, KINDS[kind]
            out.append((stream, name, start, end))
        with self._lock:
            self._records += out
            self._buffers.pop(buffer, None)
