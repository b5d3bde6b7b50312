"""The candidate worker's seccomp filter (:mod:`kb_nano.kernels.seccomp`): no new
``SIGCHLD`` action (an ignored ``SIGCHLD`` would have the kernel reap exited helpers
uncounted) and no new unix or IP socket (a tmux or D-Bus server outside the sandbox), in
the process, its threads and what it starts, and no limit set on another process;
everything else as before."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from kb_nano.kernels.seccomp import program, socket_program

CHECK = """
import os, signal, subprocess, sys, threading, time
from kb_nano.kernels.seccomp import deny_new_sockets, deny_sigchld_changes
other = threading.Thread(target=time.sleep, args=(0.5,))
other.start()  # a thread that exists before: the filter covers it too (TSYNC)
print(deny_sigchld_changes() + ", " + deny_new_sockets())
for action in (signal.SIG_IGN, signal.SIG_DFL, lambda *a: None):
    try:
        signal.signal(signal.SIGCHLD, action)
        print("allowed")
    except PermissionError:
        print("refused")
print(signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL)  # reading the action stays allowed
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # other signals are the candidate's business
print(subprocess.run(["sh", "-c", "sleep 0.05; echo shell"], capture_output=True, text=True).stdout.strip())
child = "import signal; signal.signal(signal.SIGCHLD, signal.SIG_IGN)"
print(subprocess.run([sys.executable, "-c", child], capture_output=True).returncode)  # inherited
import socket
for family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6):
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
        print("allowed")
    except PermissionError:
        print("refused")
a, b = socket.socketpair()  # connected to nothing outside: allowed
print(a.send(b"x") + b.recv(1)[0] - ord("x"))
socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close()  # glibc's interface queries
print("netlink")
import resource
parent = os.getppid()
print(resource.prlimit(parent, resource.RLIMIT_CPU) == resource.getrlimit(resource.RLIMIT_CPU))  # reading: allowed
try:
    resource.prlimit(parent, resource.RLIMIT_CPU, resource.prlimit(parent, resource.RLIMIT_CPU))
    print("allowed")
except PermissionError:
    print("refused")  # another process's limit (the judge's RLIMIT_CPU: the kernel would SIGKILL it)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # its own: allowed
print("own")
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="the filter knows x86_64 and aarch64")
def test_the_filter_refuses_new_sigchld_actions_only():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    want = ["seccomp sigchld, sockets, prlimit", "refused", "refused", "refused", "True", "shell", "1"]
    want += ["refused", "refused", "refused", "1", "netlink"]  # new unix / IP sockets; a socketpair
    want += ["True", "refused", "own"]  # another process's limits: read, not set; its own set
    assert proc.stdout.split("\n")[:15] == want


def test_the_program_jumps_stay_inside_it():
    """Every jump of the BPF program lands on an instruction, and it ends in returns."""
    for code in (program(0xC000003E, 13), socket_program(0xC000003E, 41, 302)):
        for i, (op, jt, jf, _) in enumerate(code):
            if op in (0x15, 0x35):
                assert i + 1 + max(jt, jf) < len(code)
        assert code[-1][0] == code[-2][0] == 0x06
