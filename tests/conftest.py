"""Shared test setup and fixtures.

Layout: one folder per package under test (``kernels/``, ``operators/``, ``models/``,
``e2e/``, ``eval/``, ``tracking/``, ``cli/``, ``workflow/``), no ``__init__.py``, so pytest
imports each test file by its basename: basenames must stay unique across folders. Helper
modules used by several folders (``workflow_helpers``, ``tracking_helpers``) live here,
importable by name (``pythonpath`` in pyproject.toml); a folder's own helpers and data
live in it (``workflow/slurm_cluster.py``, ``e2e/vllm_greedy.py``, ``kernels/candidate_helpers.py``,
``operators/operator_helpers.py``, ``operators/layer_model_helpers.py``,
``models/model_config_expectations.py``, ``kernels/adversarial/``, ``e2e/candidates/``), as do its
shared fixtures (``kernels/conftest.py``, ``cli/conftest.py``).
"""

from __future__ import annotations

import os

import pytest

# Every model config is vendored (config/models/): transformers must never try the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def facts_of():
    """``facts_of(key, hf_config=False)``: the kb-nano facts of a vendored model
    (:func:`kb_nano.models.configs.model_facts`; loading a config is not free, so each
    model is loaded once per session); ``hf_config=True`` adds its raw config.json fields
    (``hf_config``), as the manifest gives facts to the operators. A new dict per call
    with ``hf_config``; without it the cached one (do not mutate it)."""
    from workflow_helpers import REPO

    from kb_nano.models.configs import config_fields, load_config, model_facts, resolve

    cache: dict = {}

    def facts(key: str, hf_config: bool = False) -> dict:
        if key not in cache:
            ref = resolve(key, REPO)
            cache[key] = (model_facts(load_config(ref, REPO), ref), config_fields(ref, REPO))
        plain, fields = cache[key]
        return {**plain, "hf_config": fields} if hf_config else plain

    return facts
