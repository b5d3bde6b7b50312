"""Tier 2: full-model inference in vLLM with candidates swapped in (docs/architecture.md).

Modules: :mod:`~kb_nano.e2e.plan` (what runs: models, variants, workloads, device),
:mod:`~kb_nano.e2e.tier_jobs` (a planned tier's jobs: shard paths, inputs, params, GPUs),
:mod:`~kb_nano.e2e.job` (one model x TP x workload x variant job -> a row),
:mod:`~kb_nano.e2e.workloads` (workloads as data), :mod:`~kb_nano.e2e.vllm_plugin`
(the vLLM general plugin that swaps candidates into the engine), :mod:`~kb_nano.e2e.vllm_cli`
(``python -m kb_nano.e2e.vllm_cli`` = the ``vllm`` command), :mod:`~kb_nano.e2e.swap` and
:mod:`~kb_nano.e2e.swap_matches` (candidates into a model's module tree). Tier 3
(:mod:`kb_nano.eval`) reuses them.

Imports nothing: importing a submodule (the vLLM plugin in every vLLM process) loads only it.
"""
