"""Fixtures of the Tier-1 engine tests: the module's judge-side worker pool (a module asks
for it with ``pytestmark = pytest.mark.usefixtures("_worker_pool")``), the scenarios of
llama32-1b and of tiny models, and the CPU measurement settings."""

from __future__ import annotations

import json

import pytest
from candidate_helpers import _POOL, TINY_CONFIG, TINY_GEMMA2, TINY_GPT_OSS, TINY_PHIMOE, TINY_QWEN3_MOE
from workflow_helpers import REPO

from kb_nano.kernels.manifest import generate


@pytest.fixture(scope="module")
def _worker_pool(tmp_path_factory):
    """One judge-side worker pool for the module's measurements (workers are persistent)."""
    from kb_nano.kernels.pool import Pool

    _POOL["pool"] = Pool("cpu", {"OMP_WAIT_POLICY": "PASSIVE"}, tmp_path_factory.mktemp("pool"))
    yield
    _POOL.pop("pool").close()


def _small_vendored(key: str, small: dict) -> dict:
    """The vendored config.json of model ``key`` with the fields of ``small`` replaced."""
    from kb_nano.models.configs import resolve

    ref = resolve(key, REPO)
    path = ref.config_path if ref.config_path.is_absolute() else REPO / ref.config_path
    return {**json.loads(path.read_text()), **small}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict:
    """Scenario dicts by id: llama32-1b (real shapes) at tp 1/2 and the tiny models at tp 1/2
    (Llama, Qwen3-MoE, Gemma-2, and the vendored Phi-3.5-MoE and gpt-oss with small dims)."""
    tiny = tmp_path_factory.mktemp("tiny-llama")
    (tiny / "config.json").write_text(json.dumps(TINY_CONFIG))
    tiny_more = []
    for name, config in (
        ("tiny-qwen3-moe", TINY_QWEN3_MOE),
        ("tiny-gemma2", TINY_GEMMA2),
        ("tiny-phimoe", _small_vendored("phi35-moe", TINY_PHIMOE)),
        ("tiny-gpt-oss", _small_vendored("gpt-oss-20b", TINY_GPT_OSS)),
    ):
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
