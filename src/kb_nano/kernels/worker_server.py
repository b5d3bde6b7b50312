"""Imported by the workers' fork server at its start (its preload list,
:func:`kb_nano.kernels.pool.worker_context`), after :mod:`kb_nano.kernels.quiet_start`:
the server becomes a child subreaper (:func:`kb_nano.kernels.procs.become_subreaper`).
A candidate may turn its own worker's subreaper flag off (``prctl`` on its own process)
and detach a process by a double fork: without this, init would adopt it, outside every
tree the judge watches; with it, the fork server does, and the judge's check for
processes beside the workers (:func:`kb_nano.kernels.procs.strays`) ends the measurement
as ``tampered``. Only the fork server imports this module (the flag is per process and
not inherited by its children, the workers)."""

from kb_nano.kernels.procs import become_subreaper

become_subreaper()
