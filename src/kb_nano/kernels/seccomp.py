"""A seccomp filter for the candidate's worker: no process of it may change what its
exited children do on ``SIGCHLD``, open a new unix or IP socket, or set another process's
resource limits (``prlimit``: Landlock does not cover it; see :func:`socket_program`).

A parent that ignores ``SIGCHLD`` (``SIG_IGN``) or sets ``SA_NOCLDWAIT`` has its exited
children reaped by the kernel at once: their CPU time then reaches no process's
``cutime``/``cstime`` and no zombie keeps it, so helpers that each burn a fraction of a
millisecond and hand over to a successor would slow the baseline while the judge's
reading of the candidate's process tree (:func:`kb_nano.kernels.procs.tree_cpu_s`) sees
almost nothing. ``SA_NOCLDWAIT`` cannot be read from ``/proc``, so the worker is
filtered instead: ``rt_sigaction(SIGCHLD, act, ...)`` with a new action fails with
``EPERM`` (reading the action, ``act`` NULL, stays allowed); so does every system call
of another ABI (x86_64's i386 ``int 0x80`` and x32 calls), which the filter could not
read. Compilers that reset ``SIGCHLD`` to its default (gcc's driver) ignore the error.

Sockets: Landlock (ABI 7 and below) does not mediate ``connect()`` to a pathname unix
socket, so a candidate could ask a service outside the sandbox to act for it (a tmux
server through ``$TMUX``, the D-Bus session bus, a docker socket) or reach a local TCP
service. ``socket(AF_UNIX | AF_INET | AF_INET6, ...)`` fails with ``EPERM``; the worker's
own connection to the judge was made before the filter, and netlink (glibc's interface
queries) stays allowed.

The filter is a classic BPF program for ``seccomp(SECCOMP_SET_MODE_FILTER,
SECCOMP_FILTER_FLAG_TSYNC)`` (every thread of the process, and every process it starts,
inherits it; it cannot be removed): ``Documentation/userspace-api/seccomp_filter.rst``,
``include/uapi/linux/seccomp.h``, ``include/uapi/linux/filter.h``,
``include/uapi/linux/audit.h``; system call numbers from the kernel's
``arch/x86/entry/syscalls/syscall_64.tbl`` and ``include/uapi/asm-generic/unistd.h``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal

# audit arch, rt_sigaction, seccomp, socket, prlimit64: per architecture
_ARCH = {
    "x86_64": (0xC000003E, 13, 317, 41, 302),
    "aarch64": (0xC00000B7, 134, 277, 198, 261),
    "arm64": (0xC00000B7, 134, 277, 198, 261),
}
_AF_UNIX, _AF_INET, _AF_INET6 = 1, 2, 10  # include/linux/socket.h
# BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_JMP|BPF_JGE|BPF_K, BPF_RET|BPF_K
_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000 | errno.EPERM  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
_X32 = 0x40000000  # __X32_SYSCALL_BIT
_PR_SET_NO_NEW_PRIVS, _SET_MODE_FILTER, _FLAG_TSYNC = 38, 1, 1
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian halves)
_NR, _AUDIT_ARCH, _ARG0_LO, _ARG0_HI, _ARG1_LO, _ARG1_HI, _ARG2_LO, _ARG2_HI = 0, 4, 16, 20, 24, 28, 32, 36


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def program(audit_arch: int, nr_rt_sigaction: int) -> list[tuple[int, int, int, int]]:
    """The filter as ``(code, jt, jf, k)`` instructions (jumps relative to the next one)."""
    return [
        (_LD_ABS, 0, 0, _AUDIT_ARCH),
        (_JEQ, 1, 0, audit_arch),  # -> 3
        (_RET, 0, 0, _ERRNO),  # another ABI
        (_LD_ABS, 0, 0, _NR),
        (_JGE, 0, 1, _X32),  # -> 5 | 6
        (_RET, 0, 0, _ERRNO),  # an x32 call
        (_JEQ, 0, 6, nr_rt_sigaction),  # -> 7 | 13
        (_LD_ABS, 0, 0, _ARG0_LO),
        (_JEQ, 0, 4, int(signal.SIGCHLD)),  # -> 9 | 13
        (_LD_ABS, 0, 0, _ARG1_LO),
        (_JEQ, 0, 3, 0),  # -> 11 | 14
        (_LD_ABS, 0, 0, _ARG1_HI),
        (_JEQ, 0, 1, 0),  # -> 13 | 14
        (_RET, 0, 0, _ALLOW),
        (_RET, 0, 0, _ERRNO),  # a new SIGCHLD action
    ]


def socket_program(audit_arch: int, nr_socket: int, nr_prlimit: int) -> list[tuple[int, int, int, int]]:
    """The second filter: ``socket()`` of a unix or IP family refused, and ``prlimit64``
    that sets a limit of another process (pid not 0, a new limit given): a candidate could
    lower the judge's ``RLIMIT_CPU`` hard limit and the kernel would SIGKILL the judge, a
    death kb-nano reads as from outside, or cap the judge's and the baseline's address
    space alike, which the baseline check compares with. Reading limits, and setting the
    own process's with pid 0 (``setrlimit``), stay allowed. The ABI is checked again:
    filters are evaluated independently."""
    return [
        (_LD_ABS, 0, 0, _AUDIT_ARCH),
        (_JEQ, 1, 0, audit_arch),  # -> 3
        (_RET, 0, 0, _ERRNO),  # another ABI
        (_LD_ABS, 0, 0, _NR),
        (_JEQ, 0, 4, nr_socket),  # -> 5 | 9
        (_LD_ABS, 0, 0, _ARG0_LO),  # the domain
        (_JEQ, 12, 0, _AF_UNIX),  # -> 19 | 7
        (_JEQ, 11, 0, _AF_INET),  # -> 19 | 8
        (_JEQ, 10, 9, _AF_INET6),  # -> 19 | 18
        (_JEQ, 0, 8, nr_prlimit),  # 9: -> 10 | 18
        (_LD_ABS, 0, 0, _ARG2_LO),  # the new limit's pointer
        (_JEQ, 0, 2, 0),  # -> 12 | 14
        (_LD_ABS, 0, 0, _ARG2_HI),
        (_JEQ, 4, 0, 0),  # -> 18 (reads only) | 14
        (_LD_ABS, 0, 0, _ARG0_LO),  # 14: the pid
        (_JEQ, 0, 3, 0),  # -> 16 | 19
        (_LD_ABS, 0, 0, _ARG0_HI),
        (_JEQ, 0, 1, 0),  # -> 18 | 19
        (_RET, 0, 0, _ALLOW),  # 18
        (_RET, 0, 0, _ERRNO),  # 19: a new unix or IP socket, another process's limit
    ]


def deny_sigchld_changes() -> str:
    """Install the ``SIGCHLD`` filter (:func:`program`) on this process (all its threads)
    and whatever it starts. Returns ``"seccomp sigchld"`` for the row's ``sandbox``
    column, or ``"no seccomp: <reason>"`` when the architecture or kernel has none (nothing
    changed). Sets ``no_new_privs`` (the Landlock sandbox has already). Never raises."""
    return _install(lambda arch: program(arch[0], arch[1]), "seccomp sigchld")


def deny_new_sockets() -> str:
    """Install the socket filter (:func:`socket_program`), after the device is set up (the
    CUDA driver's start opens a unix socket: a worker filtered before it exited) and before
    the candidate is imported. Returns ``"sockets, prlimit"``, or ``"sockets allowed: <reason>"``.
    Never raises."""
    found = _install(lambda arch: socket_program(arch[0], arch[3], arch[4]), "sockets, prlimit")
    return found.replace("no seccomp", "sockets allowed")


def _install(build, name: str) -> str:
    """Install the BPF program ``build(arch)`` (``arch``: this machine's :data:`_ARCH`
    entry) with TSYNC; returns ``name`` or ``"no seccomp: <reason>"``."""
    arch = _ARCH.get(platform.machine())
    if arch is None:
        return f"no seccomp: unsupported architecture {platform.machine()}"
    code = build(arch)
    filters = (_SockFilter * len(code))(*[_SockFilter(*ins) for ins in code])
    prog = _SockFprog(len(code), filters)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
            return f"no seccomp: prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}"
        if libc.syscall(
            ctypes.c_long(arch[2]), ctypes.c_uint(_SET_MODE_FILTER), ctypes.c_uint(_FLAG_TSYNC), ctypes.byref(prog)
        ):
            return f"no seccomp: {os.strerror(ctypes.get_errno())}"
    except (OSError, AttributeError) as exc:
        return f"no seccomp: {exc}"
    return name
