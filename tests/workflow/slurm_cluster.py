"""A real one-node SLURM cluster on this machine, for tests of ``profiles/slurm``.

Debian's ``slurmctld``, ``slurmd`` and ``munge`` packages (installed with apt-get when
missing; needs root) run in the foreground as children of the test, with every file
they write (config, state, spool, logs, munge key and socket) under one directory and
free TCP ports picked at start, and leave nothing running when the test ends. Clients
(``sbatch``, ``squeue``, ``scontrol``; also the ones the Snakemake SLURM plugin calls)
find it through ``SLURM_CONF`` in :meth:`LocalSlurmCluster.env`; the one system file
touched is a symlink ``/etc/slurm/slurm.conf`` to that config while the cluster runs
(see ``SYSTEM_CONF``), and never where a real Slurm config already is.

The node advertises this machine's CPUs and memory and a GPU generic resource
(``Gres=gpu:fake:2`` backed by two stand-in device files), so that ``sbatch --gpus=1``
and ``--gpus=fake:1`` are scheduled against GPU slots on a machine without GPUs.
There is no accounting database (``AccountingStorageType=accounting_storage/none``):
``sacct`` does not work here, job states come from ``squeue``, which keeps finished
jobs for ``MinJobAge`` seconds.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel")
NODE = "kbnano1"
PARTITION = "debug"
GPUS = 2
GPU_TYPE = "fake"
MIN_JOB_AGE_S = 600
HEADER = "# written by kb-nano tests/slurm_cluster.py"
# Where Debian's Slurm clients look when SLURM_CONF is unset. The plugin's job step
# (snakemake-executor-plugin-slurm-jobstep 0.6.1) drops every SLURM_* variable,
# SLURM_CONF included, before its `srun`, so the config must also be found here.
SYSTEM_CONF = Path("/etc/slurm/slurm.conf")


class SlurmUnavailable(RuntimeError):
    """This machine cannot host the test cluster: Slurm is missing and cannot be
    installed (not root, no apt-get), or /etc/slurm/slurm.conf belongs to a real Slurm.
    Tests skip with this message."""


class ClusterError(RuntimeError):
    """The cluster was set up but did not work: a daemon exited or did not get ready, or
    a client command failed; the message carries the command or the daemon logs."""


def ensure_installed() -> None:
    """Install Debian's ``slurmctld slurmd munge`` with apt-get when a binary is missing.

    Raises SlurmUnavailable when not root or apt-get is absent, ClusterError when the
    install fails."""
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"the test cluster needs root (uid {os.geteuid()}): apt-get, slurmd and {SYSTEM_CONF}")
    if all(shutil.which(name) for name in BINARIES):
        return
    if not shutil.which("apt-get"):
        raise SlurmUnavailable("Slurm is not installed and apt-get is not available")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode or not all(shutil.which(name) for name in BINARIES):
        raise ClusterError(
            f"apt-get install {' '.join(PACKAGES)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise ClusterError("/proc/meminfo has no MemTotal line")


class LocalSlurmCluster:
    """One controller and one compute node (``kbnano1``, partition ``debug``) on this host.

    ``root``: an empty directory owned by root with mode 0700 (munged refuses keys and
    sockets in group/world-writable directories). Use as a context manager: ``__enter__``
    starts munged, slurmctld and slurmd and waits until the node is idle (raises
    ClusterError with the daemon logs on failure); ``__exit__`` cancels remaining
    jobs and stops the daemons, also when the body raised.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.linked = False

    def env(self) -> dict[str, str]:
        """``os.environ`` plus ``SLURM_CONF`` pointing at this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        proc = subprocess.run(list(cmd), capture_output=True, text=True, env=self.env(), timeout=60)
        if check and proc.returncode:
            raise ClusterError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
        return proc

    def _write_config(self) -> None:
        r = self.root
        for sub in ("state", "spool", "munge"):
            (r / sub).mkdir(mode=0o700, exist_ok=True)
        key = r / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(128))
            key.chmod(0o400)
        cpus = os.cpu_count() or 1
        memory = int(_memory_mb() * 0.9)
        self.conf.write_text(
            f"""{HEADER}
ClusterName=kbnano
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: a container may not delegate them
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge={MIN_JOB_AGE_S}
GresTypes=gpu
NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} CPUs={cpus} RealMemory={memory} Gres=gpu:{GPU_TYPE}:{GPUS} State=UNKNOWN
PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""
        )
        # Slurm drops a GPU without device files from the node; character devices with
        # /dev/null's numbers stand in (a plain file also works, with an error logged).
        for i in range(GPUS):
            dev = r / f"fake-gpu{i}"
            if not dev.exists():
                try:
                    os.mknod(dev, stat.S_IFCHR | 0o600, os.makedev(1, 3))
                except OSError:
                    dev.touch()
        (r / "gres.conf").write_text(f"NodeName={NODE} Name=gpu Type={GPU_TYPE} File={r}/fake-gpu[0-{GPUS - 1}]\n")

    def _link_system_conf(self) -> None:
        """Point /etc/slurm/slurm.conf at this cluster's config. A file there that this
        module did not write is left alone (SlurmUnavailable); a link left by an
        earlier, interrupted run is replaced."""
        if SYSTEM_CONF.is_symlink() or SYSTEM_CONF.exists():
            ours = SYSTEM_CONF.is_symlink() and (not SYSTEM_CONF.exists() or SYSTEM_CONF.read_text().startswith(HEADER))
            if not ours:
                raise SlurmUnavailable(
                    f"{SYSTEM_CONF} belongs to a Slurm set up on this machine; the test cluster will not replace it"
                )
            SYSTEM_CONF.unlink()
        SYSTEM_CONF.parent.mkdir(parents=True, exist_ok=True)
        SYSTEM_CONF.symlink_to(self.conf)
        self.linked = True

    def _unlink_system_conf(self) -> None:
        if self.linked and SYSTEM_CONF.is_symlink() and os.readlink(SYSTEM_CONF) == str(self.conf):
            SYSTEM_CONF.unlink()
        self.linked = False

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env())
        log.close()

    def _logs(self) -> str:
        parts = []
        for name in ("munged.out", "munged.log", "slurmctld.out", "slurmctld.log", "slurmd.out", "slurmd.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(parts)

    def _wait(self, what: str, ready, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise ClusterError(f"{name} exited with {proc.returncode} while waiting for {what}\n{self._logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise ClusterError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self._logs()}")

    def node_state(self) -> str:
        """``sinfo``'s state of the node (``idle``, ``mix``, ``alloc``, ``down``, ...), or ''."""
        proc = self.run("sinfo", "--noheader", "--nodes", NODE, "--format", "%T", check=False)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def __enter__(self) -> LocalSlurmCluster:
        ensure_installed()
        self._write_config()
        r = self.root
        try:
            self._link_system_conf()
            self._start(
                "munged",
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--socket={r}/munge/munge.socket",
                    f"--key-file={r}/munge/munge.key",
                    f"--pid-file={r}/munge/munged.pid",
                    f"--log-file={r}/munged.log",
                    f"--seed-file={r}/munge/munged.seed",
                ],
            )
            self._wait("munged's socket", lambda: (r / "munge" / "munge.socket").exists())
            # -D foreground, -c clear any earlier state in this directory, -i ignore errors in it
            self._start("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.conf)])
            self._wait("slurmctld", lambda: self.run("scontrol", "ping", check=False).stdout.count("UP") > 0)
            self._start("slurmd", ["slurmd", "-D", "-N", NODE, "-f", str(self.conf)])
            self._wait(f"node {NODE} to be idle", lambda: self.node_state() == "idle")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel this cluster's jobs, then stop slurmd, slurmctld and munged (SIGTERM,
        SIGKILL after 15 s)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--partition", PARTITION, check=False)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._unlink_system_conf()

    def __exit__(self, *exc) -> None:
        self.stop()
