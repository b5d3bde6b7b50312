"""Fixtures of the Tier-1 engine tests: the module's judge-side worker pool (a module asks
for it with ``pytestmark = pytest.mark.usefixtures("_worker_pool")``), the scenarios of
llama32-1b and of tiny models, and the CPU measurement settings."""

from __future__ import annotations

import json

import pytest
from candidate_helpers import _POOL, TINY_CONFIG, TINY_GEMMA2, TINY_QWEN3_MOE
from workflow_helpers import REPO

from kb_nano.kernels.manifest import generate


@pytest.fixture(scope="module")
def _worker_pool(tmp_path_factory):
    """One judge-side worker pool for the module's measurements (workers are persistent)."""
    from kb_nano.kernels.pool import Pool

    _POOL["pool"] = Pool("cpu", {"OMP_WAIT_POLICY": "PASSIVE"}, tmp_path_factory.mktemp("pool"))
    yield
    _POOL.pop("pool").close()


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict:
    """Scenario dicts by id: llama32-1b (real shapes) at tp 1/2 and the tiny model at tp 1/2."""
    tiny = tmp_path_factory.mktemp("tiny-llama")
    (tiny / "config.json").write_text(json.dumps(TINY_CONFIG))
    tiny_more = []
    for name, config in (("tiny-qwen3-moe", TINY_QWEN3_MOE), ("tiny-gemma2", TINY_GEMMA2)):
        path = tmp_path_factory.mktemp(name)
        (path / "config.json").write_text(json.dumps(config))
        tiny_more.append(str(path))
    out = {}
    for models in (["llama32-1b"], [str(tiny), *tiny_more]):
        manifest = generate(models, [1, 2], [4], "auto", REPO)
        out.update({s["scenario_id"]: s for s in manifest["scenarios"]})
    return out


@pytest.fixture
def settings():
    # keep the process-wide thread count as it is (measure sets it)
    return {
        "device": "cpu",
        "atol": 0.01,
        "rtol": 0.01,
        "num_warmup": 1,
        "num_runs": 3,
        "num_threads": 1,
        "timeout_s": 120,
    }
