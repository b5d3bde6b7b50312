"""Imported first by kb-nano's fork servers (the judges', :func:`kb_nano.kernels.job.judge_context`,
and the workers', :func:`kb_nano.kernels.pool.worker_context`): SIGINT is ignored while the
server imports its other modules (Snakemake's CLI, torch: seconds), so a Ctrl-C then ends
the run without a KeyboardInterrupt traceback from the server. multiprocessing's fork
server ignores SIGINT itself once its imports are done; the judge
(:func:`kb_nano.kernels.judge_process.serve`) and each worker
(:mod:`kb_nano.kernels.worker_process`) restore SIGINT's default action first thing.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
