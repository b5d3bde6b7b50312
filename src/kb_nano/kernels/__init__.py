"""Tier 1: one operator in isolation, a candidate against the baseline.

The plan is the scenario manifest (:mod:`~kb_nano.kernels.manifest`: operator x model x TP
x num_tokens, generated from the model configs at parse time); the other modules are the
engine that measures one scenario, and its rows' schema, merge and table.

A kernel job (:mod:`~kb_nano.kernels.job`, in the Snakemake process) hands its scenario to
the judge process of its device (:mod:`~kb_nano.kernels.judge_process`), which measures it
(:mod:`~kb_nano.kernels.measure`, :mod:`~kb_nano.kernels.judge`) with two kinds of worker
process (:mod:`~kb_nano.kernels.pool`, :mod:`~kb_nano.kernels.worker_process`,
:mod:`~kb_nano.kernels.worker`): the baseline's, and a sandboxed one per candidate
(:mod:`~kb_nano.kernels.sandbox`). Inputs and outputs cross between them in shared memory
(:mod:`~kb_nano.kernels.shm`); the values come from :mod:`~kb_nano.kernels.inputs`; the
clocks and statistics are :mod:`~kb_nano.kernels.timing`; the rules are
:mod:`~kb_nano.kernels.checks` and :mod:`~kb_nano.kernels.guard` (in the workers) and the
judge's own; :mod:`~kb_nano.kernels.compare` decides correctness; shards are signed
(:mod:`~kb_nano.kernels.signing`).
"""
