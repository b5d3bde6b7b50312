"""Checks the vendored Hugging Face config.json files under config/models/.

Each config must load with ``transformers.AutoConfig`` and carry the kernel-relevant
facts in model_config_expectations.py (literal expectations, so the test runs where the shared reference file is
missing). When ``../shared/reference/hf_model_facts.json`` (relative to the repo root)
exists, every fact in it is checked as well.

transformers 5 folds ``rope_theta``/``rope_scaling`` into ``config.rope_parameters``,
so those two are checked against the raw JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from model_config_expectations import (
    ABSENT,
    COMMON_RAW_KEYS,
    EXPECTED,
    EXPECTED_KEYS,
    FACTS_FILE,
    MODELS_DIR,
    MODELS_YAML,
    NOT_IN_SHARED_REFERENCE,
    VERBATIM,
)
from workflow_helpers import REPO

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig  # noqa: E402


def config_dir(hub_id: str) -> Path:
    return MODELS_DIR / hub_id


def load_raw(hub_id: str) -> dict:
    with open(config_dir(hub_id) / "config.json") as f:
        return json.load(f)


_CONFIG_CACHE: dict = {}


def load_config(hub_id: str):
    if hub_id not in _CONFIG_CACHE:
        _CONFIG_CACHE[hub_id] = AutoConfig.from_pretrained(str(config_dir(hub_id)))
    return _CONFIG_CACHE[hub_id]


def head_dim_of(config) -> int:
    hd = getattr(config, "head_dim", None)
    return hd if hd is not None else config.hidden_size // config.num_attention_heads


def dtype_name(config) -> str:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return str(dt).replace("torch.", "")


def attr(config, key):
    if key == "head_dim":
        return head_dim_of(config)
    return getattr(config, key)


def same(actual, expected) -> bool:
    # bool is an int subclass: keep True != 1 distinct.
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(actual) is type(expected) and actual == expected
    return actual == expected


def test_models_yaml_maps_exact_keys():
    mapping = yaml.safe_load(MODELS_YAML.read_text())
    assert mapping == EXPECTED_KEYS
    for hub_id in mapping.values():
        assert (config_dir(hub_id) / "config.json").is_file(), hub_id


def test_expectations_cover_every_model():
    assert set(EXPECTED) | set(VERBATIM) == set(EXPECTED_KEYS.values())


@pytest.mark.parametrize("hub_id", sorted(VERBATIM))
def test_verbatim_configs_match_their_source(hub_id):
    import hashlib
    import re

    config = (config_dir(hub_id) / "config.json").read_bytes()
    source = (config_dir(hub_id) / "SOURCE.md").read_text()
    assert hashlib.sha256(config).hexdigest() in re.findall(r"\b[0-9a-f]{64}\b", source)
    assert json.loads(config)["model_type"] == VERBATIM[hub_id]


@pytest.mark.parametrize("hub_id", sorted(EXPECTED))
def test_raw_json_shape(hub_id):
    path = config_dir(hub_id) / "config.json"
    text = path.read_text()
    raw = json.loads(text)
    # 2-space indented, in file order, trailing newline
    assert text == json.dumps(raw, indent=2) + "\n"
    for key in COMMON_RAW_KEYS:
        assert key in raw, f"{hub_id}: missing {key}"
    assert raw["torch_dtype"] == EXPECTED[hub_id]["raw"].get("torch_dtype", "bfloat16")


@pytest.mark.parametrize("hub_id", sorted(EXPECTED))
def test_autoconfig_loads_and_matches(hub_id):
    config = load_config(hub_id)
    exp = EXPECTED[hub_id]
    assert config.model_type == exp["attrs"]["model_type"]
    for key, want in exp["attrs"].items():
        got = attr(config, key)
        assert same(got, want), f"{hub_id}: {key} = {got!r}, want {want!r}"
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert dtype_name(config) == exp["raw"].get("torch_dtype", "bfloat16")


@pytest.mark.parametrize("hub_id", sorted(EXPECTED))
def test_raw_rope_and_dtype(hub_id):
    raw = load_raw(hub_id)
    exp = EXPECTED[hub_id]
    for key, want in exp["raw"].items():
        if want is ABSENT:
            assert key not in raw, f"{hub_id}: {key} must be absent"
        else:
            assert key in raw, f"{hub_id}: {key} missing"
            assert same(raw[key], want), f"{hub_id}: {key} = {raw[key]!r}, want {want!r}"
    for key in exp.get("raw_none", []):
        assert raw.get(key) is None, f"{hub_id}: {key} must be null or absent"
    # transformers 5 folds rope_theta into rope_parameters; it must agree with the raw file
    config = load_config(hub_id)
    rope_params = getattr(config, "rope_parameters", None)
    if rope_params is not None:
        assert rope_params["rope_theta"] == raw["rope_theta"]
        if raw.get("rope_scaling"):
            assert rope_params["rope_type"] == raw["rope_scaling"]["rope_type"]
            assert rope_params["factor"] == raw["rope_scaling"]["factor"]
        else:
            assert rope_params.get("rope_type", "default") == "default"


@pytest.mark.parametrize("hub_id", sorted(EXPECTED))
def test_moe_fields(hub_id):
    raw = load_raw(hub_id)
    is_moe = EXPECTED[hub_id].get("moe", False)
    has_experts = any(k in raw for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    assert has_experts == is_moe
    # none of these models has shared experts
    assert not any("shared_expert" in k for k in raw), hub_id


def _check_fact(hub_id, key, want, raw, config):
    if key.endswith("_in_code"):
        return  # behaviour fixed by the architecture's code, not a config key
    if key == "head_dim_derived":
        assert "head_dim" not in raw or raw["head_dim"] is None
        assert config.hidden_size // config.num_attention_heads == want
        assert head_dim_of(config) == want
        return
    if key.endswith("_derived"):
        return
    if key == "shared_experts":
        # a note (no such config key): the model has no shared expert
        assert want == 0
        assert not any("shared_expert" in k for k in raw)
        return
    if want == "absent":
        assert key not in raw, f"{hub_id}: {key} must be absent"
        return
    if key in raw:
        got = raw[key]
    elif want is None:
        got = raw.get(key)  # null and absent read the same
    else:
        got = attr(config, key)
    assert same(got, want), f"{hub_id}: {key} = {got!r}, want {want!r}"


@pytest.mark.skipif(not FACTS_FILE.is_file(), reason="shared reference facts not present")
@pytest.mark.parametrize("hub_id", sorted(EXPECTED))
def test_shared_reference_facts(hub_id):
    facts = json.loads(FACTS_FILE.read_text())
    if hub_id not in facts and hub_id in NOT_IN_SHARED_REFERENCE:
        pytest.skip(f"{hub_id} is not in {FACTS_FILE.name}")
    assert hub_id in facts, f"{hub_id} missing from {FACTS_FILE}"
    raw = load_raw(hub_id)
    config = load_config(hub_id)
    for key, want in facts[hub_id].items():
        _check_fact(hub_id, key, want, raw, config)


def test_manifest_generation_reads_configs_without_the_optional_vision_and_sklearn_imports(tmp_path):
    """A fresh process generating a manifest does not import torchvision or scikit-learn
    (transformers imports them when installed; the manifest needs config classes only),
    and both are importable again afterwards."""
    import subprocess
    import sys

    code = f"""
import importlib.util, sys
from pathlib import Path
from kb_nano.kernels.manifest import cached
from kb_nano.workflow import manifest_params
root = Path({str(REPO)!r})
params = manifest_params({{"models": ["llama32-1b"], "tp": [1], "num_tokens": [1], "dtype": "auto",
                          "context_lens": None, "targets": ["rms_norm"]}})
data, how = cached(Path({str(tmp_path / "m.yaml")!r}), root, params, [])
assert how == "generated" and data["scenarios"], how
assert "transformers" in sys.modules
loaded = [n for n in ("torchvision", "sklearn") if n in sys.modules]
assert not loaded, loaded
if importlib.util.find_spec("sklearn") is not None:
    import sklearn.metrics  # importable again after the block
print("ok")
"""
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
