"""Tier 3: the standardized eval sweep (docs/architecture.md).

Modules: :mod:`~kb_nano.eval.plan` (fixed workloads x model x TP x {baseline, candidates},
the skipped rows); the jobs themselves are Tier 2's (:mod:`kb_nano.e2e.tier_jobs`,
:mod:`kb_nano.e2e.job`).

Imports nothing: importing a submodule loads only it.
"""
