"""Checks the vendored Hugging Face config.json files under config/models/.

Each config must load with ``transformers.AutoConfig`` and carry the kernel-relevant
facts below (literal expectations, so the test runs where the shared reference file is
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
from workflow_helpers import REPO

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig  # noqa: E402

MODELS_DIR = REPO / "config" / "models"
MODELS_YAML = MODELS_DIR / "models.yaml"
FACTS_FILE = REPO.parent / "shared" / "reference" / "hf_model_facts.json"

ABSENT = object()  # the key must not appear in config.json

EXPECTED_KEYS = {
    "llama31-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama31-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "llama32-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "qwen25-7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "mistral-7b-v03": "mistralai/Mistral-7B-Instruct-v0.3",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "gemma2-2b": "google/gemma-2-2b",
    **{
        "gemma3-4b": "google/gemma-3-4b-it",
        "deepseek-v3": "deepseek-ai/DeepSeek-V3",
        "gpt-oss-20b": "openai/gpt-oss-20b",
        "llama4-scout": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
        "phi35-moe": "microsoft/Phi-3.5-MoE-instruct",
    },
}
# vendored byte for byte with a SOURCE.md (where the file was found and its sha256), checked
# by test_verbatim_configs_match_their_source rather than against the expectations below
VERBATIM = {
    "google/gemma-3-4b-it": "gemma3",
    "deepseek-ai/DeepSeek-V3": "deepseek_v3",
    "openai/gpt-oss-20b": "gpt_oss",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": "llama4",
    "microsoft/Phi-3.5-MoE-instruct": "phimoe",
}

_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Attribute facts are compared with the AutoConfig-loaded config; "raw" facts with config.json.
EXPECTED = {
    "meta-llama/Llama-3.1-8B-Instruct": {
        "attrs": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 128256,
            "rms_norm_eps": 1e-05,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
        },
        "raw": {"rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE, "torch_dtype": "bfloat16"},
    },
    "meta-llama/Llama-3.1-70B-Instruct": {
        "attrs": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 128256,
            "rms_norm_eps": 1e-05,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            "eos_token_id": [128001, 128008, 128009],
        },
        "raw": {"rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE, "torch_dtype": "bfloat16"},
    },
    "meta-llama/Llama-3.2-1B-Instruct": {
        "attrs": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "rms_norm_eps": 1e-05,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "hidden_act": "silu",
        },
        "raw": {
            "head_dim": 64,
            "rope_theta": 500000.0,
            "rope_scaling": {**_LLAMA31_ROPE, "factor": 32.0},
            "torch_dtype": "bfloat16",
        },
    },
    "Qwen/Qwen2.5-7B-Instruct": {
        "attrs": {
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "head_dim": 128,  # derived: hidden_size / num_attention_heads
            "vocab_size": 152064,
            "rms_norm_eps": 1e-06,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "hidden_act": "silu",
        },
        # rope_scaling is null-or-absent (the Hub file omits the key); QKV bias is fixed in code.
        "raw": {"rope_theta": 1000000.0, "torch_dtype": "bfloat16"},
        "raw_none": ["rope_scaling"],
    },
    "Qwen/Qwen3-8B": {
        "attrs": {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "rms_norm_eps": 1e-06,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "hidden_act": "silu",
        },
        "raw": {"head_dim": 128, "rope_theta": 1000000, "rope_scaling": None, "torch_dtype": "bfloat16"},
    },
    "mistralai/Mistral-7B-Instruct-v0.3": {
        "attrs": {
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 32768,
            "rms_norm_eps": 1e-05,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
            "sliding_window": None,
            "hidden_act": "silu",
        },
        "raw": {
            "rope_theta": 1000000.0,
            "rope_scaling": ABSENT,
            "sliding_window": None,
            "torch_dtype": "bfloat16",
        },
    },
    "mistralai/Mixtral-8x7B-Instruct-v0.1": {
        "attrs": {
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,  # derived
            "vocab_size": 32000,
            "rms_norm_eps": 1e-05,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
            "sliding_window": None,
            "hidden_act": "silu",
        },
        "raw": {
            "rope_theta": 1000000.0,
            "rope_scaling": ABSENT,
            "sliding_window": None,
            "torch_dtype": "bfloat16",
        },
        "moe": True,
    },
    "Qwen/Qwen3-30B-A3B": {
        "attrs": {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "rms_norm_eps": 1e-06,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "hidden_act": "silu",
        },
        "raw": {"head_dim": 128, "rope_theta": 1000000.0, "rope_scaling": None, "torch_dtype": "bfloat16"},
        "moe": True,
    },
    # GeGLU (gelu_pytorch_tanh) and attention soft-capping; the checkpoint is float32.
    "google/gemma-2-2b": {
        "attrs": {
            "model_type": "gemma2",
            "architectures": ["Gemma2ForCausalLM"],
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "vocab_size": 256000,
            "rms_norm_eps": 1e-06,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "sliding_window": 4096,
        },
        "raw": {"head_dim": 256, "rope_theta": 10000.0, "rope_scaling": ABSENT, "torch_dtype": "float32"},
    },
}

# Vendored after the shared reference file was collected (checked by EXPECTED only).
NOT_IN_SHARED_REFERENCE = ("google/gemma-2-2b",)

# Raw keys every vendored file carries, as the Hub files do.
COMMON_RAW_KEYS = (
    "architectures",
    "model_type",
    "hidden_act",
    "bos_token_id",
    "eos_token_id",
    "initializer_range",
    "attention_dropout",
    "torch_dtype",
    "transformers_version",
    "use_cache",
)


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
