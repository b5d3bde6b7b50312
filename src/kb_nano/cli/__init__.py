"""The ``kb_nano`` command line: a front for the Snakemake workflow.

Each command turns its flags into Snakemake targets and ``--config`` overrides and runs
the same DAG as ``snakemake --cores all`` (never a second code path), then prints the
merged results. Arguments after ``--`` go to Snakemake unchanged
(``kb_nano kernels -- --profile profiles/slurm``).
"""


def main(argv: list[str] | None = None) -> int:
    """The ``kb_nano`` entry point (``pyproject.toml``'s script): :func:`kb_nano.cli.parser.main`,
    imported when called so that importing a submodule (``kb_nano.cli.flags``) does not
    import every command's module and no submodule imports this package back.
    Returns the process exit status.

    Called as the command (``argv`` None), a process that still has a daemon thread at
    work (the manifest thread of :func:`kb_nano.workflow.start_manifest`, when a Ctrl-C or
    an early error ends the run while it imports torch) ends here with ``os._exit`` after
    flushing its output: the interpreter's shutdown would end that thread with
    ``pthread_exit`` inside torch's C++ code, which aborts the process ("terminate called
    without an active exception", status -6) instead of ending it with its status. Before
    its imports it installs :func:`_quiet_while_importing`."""
    if argv is None:
        _quiet_while_importing()
    from kb_nano.cli.parser import main as parser_main

    code = parser_main(argv)
    if argv is None:
        _end_past_daemon_threads(code)
    return code


def _end_past_daemon_threads(code: int) -> None:
    import os
    import sys
    import threading

    if any(t.daemon and t.is_alive() for t in threading.enumerate()):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):  # closed (>&-) or a reader gone (| head)
                pass
        os._exit(code)


def _quiet_while_importing() -> None:
    """Until the command's own handlers (:func:`kb_nano.interrupts.interrupts`) replace
    them, SIGINT, SIGTERM and SIGHUP (not ones inherited as ignored) end the process with
    one line and status 130, instead of a ``KeyboardInterrupt`` traceback from the middle
    of an import (or no line at all for SIGTERM)."""
    import os
    import signal

    def end(signum, _frame) -> None:
        os.write(2, f"interrupted ({signal.Signals(signum).name}) while kb_nano was starting\n".encode())
        os._exit(130)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, end)
