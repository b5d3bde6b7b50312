"""Helpers of the L3 ``decoder_layer`` / L4 ``model`` tests (test_layer_model_baselines,
test_layer_model_rules, test_layer_model_candidates): small configs of the two architectures,
the shipped candidates, and the transformers reference built independently of kb_nano."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig
from workflow_helpers import REPO

from kb_nano.kernels.inputs import randomize_constant_parameters

MODELS = REPO / "config/models"
LAYER_CANDIDATE = REPO / "candidates/decoder_layer/sdpa_fused.py"
MODEL_CANDIDATE = REPO / "candidates/model/sdpa.py"

# Small configs of the two architectures (real field sets, small sizes) for the model-level
# and bf16-accuracy tests; the layer tests also use the vendored real configs.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "vocab_size": 1000,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 3,
    "vocab_size": 1200,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
}


def raw(hub_id: str) -> dict:
    """The vendored config.json of ``hub_id`` (config/models/<hub_id>/), as a dict."""
    return json.loads((MODELS / hub_id / "config.json").read_text())


def gen(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def perturb_norms(module: torch.nn.Module) -> None:
    """Norm weights are ones after init; make them tell a candidate that ignores them."""
    randomize_constant_parameters(module, seed=123)


def hf_reference_config(config: dict, tp: int = 1, num_hidden_layers: int | None = None):
    """The per-rank config built by hand (independently of kb_nano.operators.layers)."""
    cfg = AutoConfig.for_model(**config)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    cfg.head_dim = cfg.head_dim or cfg.hidden_size // heads
    cfg.num_attention_heads = heads // tp
    cfg.num_key_value_heads = max(kv // tp, 1)
    cfg.intermediate_size = cfg.intermediate_size // tp
    if num_hidden_layers:
        cfg.num_hidden_layers = num_hidden_layers
    cfg._attn_implementation = "eager"
    return cfg


def causal_mask(n: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive causal mask of ``n`` tokens, [1, 1, n, n] in ``dtype``."""
    return torch.full((n, n), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
