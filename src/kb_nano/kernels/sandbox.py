"""Landlock sandbox for the worker that imports an untrusted candidate kernel.

:func:`restrict` confines the calling process (and every process it starts afterwards):

* writes only beneath the ``writable`` paths and ``/dev`` (``/dev/null``, ``/dev/shm``,
  ``/dev/nvidia*``; device ioctls stay allowed);
* reads everywhere except beneath the ``hidden`` paths (the project's ``results/``: result
  shards and the HMAC key). Listing a directory on the way from ``/`` to a hidden path is
  denied too, and ``stat`` (names, sizes, times) is not restricted by Landlock at all;
* with ABI >= 6 no signals to, and no abstract-unix-socket connections with, processes
  outside the sandbox;
* always (every ABI): no ``ptrace`` of processes outside the sandbox, hence no opening
  their ``/proc/<pid>/mem`` nor following ``/proc/<pid>/fd/*``, ``cwd``, ``root``. (Measured
  on Linux 6.18, ABI 7: their ``environ``, ``maps``, ``auxv`` stayed readable, and the
  ``fd`` numbers listable: keep secrets such as the HMAC key out of environment variables.)

The caller must keep a temporary directory writable (``tempfile``: ``import torch`` fails
without one), e.g. ``TMPDIR`` beneath a ``writable`` path. Modules directly in a directory
on the way to a hidden path (the project root as cwd) can no longer be found once Python's
directory cache for it is refreshed: that directory cannot be listed.

Landlock is applied with raw syscalls through ctypes (no third-party package). The
constants and structures are those of the kernel documentation
``Documentation/userspace-api/landlock.rst`` (``include/uapi/linux/landlock.h``).
"""

from __future__ import annotations

import ctypes
import os
import platform
import stat
import sys
from pathlib import Path

# Documentation/userspace-api/landlock.rst: syscall numbers (same on x86_64 and aarch64).
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_PR_SET_NO_NEW_PRIVS = 38
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
# Filesystem access rights (landlock.rst, "Filesystem flags").
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK = 1 << 8, 1 << 9, 1 << 10, 1 << 11
MAKE_SYM, REFER, TRUNCATE = 1 << 12, 1 << 13, 1 << 14  # REFER: ABI 2, TRUNCATE: ABI 3
# IOCTL_DEV (1 << 15, ABI 5) is deliberately never handled: ioctls on devices stay allowed.
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
_READ = EXECUTE | READ_FILE | READ_DIR
_FILE = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE  # the only rights a non-directory takes
_ARCHES = {"x86_64", "aarch64", "arm64"}


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _probe() -> tuple[int, str]:
    """(ABI version, reason when 0)."""
    if not sys.platform.startswith("linux"):
        return 0, f"not Linux ({sys.platform})"
    if platform.machine() not in _ARCHES:
        return 0, f"unsupported architecture {platform.machine()}"
    try:
        libc = _libc()
        abi = libc.syscall(
            ctypes.c_long(_SYS_CREATE_RULESET), None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION)
        )
    except (OSError, AttributeError) as e:
        return 0, f"no syscall(): {e}"
    if abi <= 0:
        return 0, f"landlock unavailable ({os.strerror(ctypes.get_errno())})"
    return int(abi), ""


def abi_version() -> int:
    """Landlock ABI version of the running kernel, 0 when unavailable (not Linux,
    disabled, or the syscall fails). Never raises."""
    return _probe()[0]


def _beneath(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _add(libc: ctypes.CDLL, ruleset: int, fd: int, access: int, path: str) -> None:
    attr = _PathBeneathAttr(access, fd)
    if libc.syscall(
        ctypes.c_long(_SYS_ADD_RULE),
        ctypes.c_int(ruleset),
        ctypes.c_int(_RULE_PATH_BENEATH),
        ctypes.byref(attr),
        ctypes.c_uint32(0),
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_add_rule: {os.strerror(err)}", path)


def _grant(
    libc: ctypes.CDLL,
    ruleset: int,
    path: str,
    access: int,
    handled: int,
    dir_fd: int | None = None,
    must_exist: bool = False,
) -> None:
    """Add a path-beneath rule for ``path`` (symlinks are not followed; a non-directory
    gets only file rights). Unopenable entries are skipped unless ``must_exist``."""
    flags = os.O_PATH | os.O_CLOEXEC | (0 if must_exist else os.O_NOFOLLOW)
    try:
        fd = os.open(os.path.basename(path) if dir_fd is not None else path, flags, dir_fd=dir_fd)
    except OSError as e:
        if must_exist:
            raise OSError(e.errno, f"cannot open writable path: {e.strerror}", path) from e
        return
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISLNK(mode):
            return
        if not stat.S_ISDIR(mode):
            access &= _FILE
        _add(libc, ruleset, fd, access & handled, path)
    finally:
        os.close(fd)


def restrict(writable: list[str | Path], hidden: list[str | Path]) -> str:
    """Apply Landlock to the calling thread and every thread/process it starts afterwards.

    * Writes (every filesystem write right of the ABI, including REFER from ABI 2 and
      TRUNCATE from ABI 3) are allowed only beneath the ``writable`` paths and ``/dev``.
    * Reads (READ_FILE, READ_DIR, EXECUTE) are allowed everywhere except beneath each
      ``hidden`` path: walking from ``/`` to each hidden path, every sibling entry of
      the path's components gets read rights; the directories on the way (and so the
      hidden path) get none, so they cannot be listed either. A ``writable`` path
      beneath a hidden path stays readable and writable. A hidden path that does not
      exist yet is never granted; nothing is created.
    * With ABI >= 6 also scopes signals and abstract unix sockets to the sandbox.

    Landlock restricts only the calling thread and its future children: call this
    before starting other threads. Constants: ``Documentation/userspace-api/landlock.rst``.

    Returns a description for the result row (``"landlock abi 7"``), or ``"none:
    <reason>"`` when Landlock is unavailable (then nothing changes; never raises for an
    unsupported kernel). Raises ValueError, before changing anything, when a writable
    path (or ``/dev``) contains a hidden path (Landlock cannot allow writes in a
    directory without allowing them beneath it), and OSError (with the path) for a
    failure after the ruleset was created: a writable path that cannot be opened,
    landlock_add_rule, prctl or landlock_restrict_self failing.
    """
    abi = abi_version()
    if abi <= 0:
        return "none: " + (_probe()[1] or "landlock unavailable")
    writes = [os.path.realpath(p) for p in writable]
    hides = sorted({os.path.realpath(p) for p in hidden})
    hides = [h for h in hides if not any(o != h and _beneath(h, o) for o in hides)]
    for w in [*writes, "/dev"]:
        for h in hides:
            if w != h and _beneath(h, w):
                raise ValueError(f"writable path {w} contains hidden path {h}")
    handled = (1 << 13) - 1 | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(handled, 0, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    libc = _libc()
    ruleset = libc.syscall(
        ctypes.c_long(_SYS_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)
    )
    if ruleset < 0:
        return f"none: landlock_create_ruleset failed ({os.strerror(ctypes.get_errno())})"
    try:
        # Directories from / down to each hidden path: grant their other entries.
        ancestors = {str(p) for h in hides for p in Path(h).parents}
        for anc in sorted(ancestors):
            try:
                names = os.listdir(anc)
                dir_fd = os.open(anc, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                for name in names:
                    full = os.path.join(anc, name)
                    if full not in ancestors and full not in hides:
                        _grant(libc, ruleset, full, _READ, handled, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
        if not hides:
            _grant(libc, ruleset, "/", _READ, handled, must_exist=True)
        for w in [*writes, "/dev"]:
            _grant(libc, ruleset, w, handled, handled, must_exist=True)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
        if libc.syscall(ctypes.c_long(_SYS_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)):
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")
    finally:
        os.close(ruleset)
    return f"landlock abi {abi}"
