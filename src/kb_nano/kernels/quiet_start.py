"""Imported first by kb-nano's fork servers (the judges', :func:`kb_nano.kernels.job.judge_context`,
and the workers', :func:`kb_nano.kernels.pool.worker_context`): SIGINT is ignored while the
server imports its other modules (Snakemake's CLI, torch: seconds), so a Ctrl-C then ends
the run without a KeyboardInterrupt traceback from the server. multiprocessing's fork
server ignores SIGINT itself once its imports are done; the judge
(:func:`kb_nano.kernels.judge_process.serve`) and each worker
(:mod:`kb_nano.kernels.worker_process`) restore SIGINT's default action first thing.
The servers start with SIGINT blocked (:func:`kb_nano.kernels.procs.sigint_blocked`),
which this module lifts, so no Ctrl-C reaches them before it runs. Importing it ignores
SIGINT in the importing process: only the fork servers import it.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a Ctrl-C already pending is dropped
