"""``python -m kb_nano.snakemake_main ARGS``: Snakemake's command line as ``kb_nano``
runs it (:func:`kb_nano.launch.run_snakemake`), quiet when interrupted while it
starts: a Ctrl-C during Snakemake's own imports (a second or two), while it parses the
workflow (the manifest) or builds the DAG ends the process with status 130 and no
KeyboardInterrupt traceback. From the imports on SIGINT raises KeyboardInterrupt, which
Snakemake's job scheduler turns into its clean shutdown, and is noted first
(:func:`kb_nano.interrupts.watch`): the kernel jobs it stops end as interrupted, what
Snakemake would report about them is left out, and the process exits with status 130,
so ``kb_nano`` ends the run with its own one line.

Module-level code is only the guard: multiprocessing's children import this module
again as ``__mp_main__``, and must not start Snakemake.
"""

from __future__ import annotations

import signal
import sys


def _quiet_exit(signum, frame) -> None:
    raise SystemExit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _quiet_exit)
    from snakemake.cli import main

    from kb_nano.interrupts import interrupted, watch

    signal.signal(signal.SIGINT, signal.default_int_handler)
    watch(quiet=True)
    try:
        main()  # exits itself
    except KeyboardInterrupt:  # while it parses the workflow or builds the DAG (its job scheduler handles its own)
        sys.exit(130)
    except SystemExit as exc:  # the scheduler stopped on the interrupt: the run failed because of it
        if interrupted() and exc.code not in (0, None):
            sys.exit(130)
        raise
