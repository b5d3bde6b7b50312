"""What the vendored Hugging Face config.json files under config/models/ must say, for
test_model_configs: the keys of models.yaml, the files vendored verbatim, the literal
kernel-relevant facts per model and the raw keys every file carries."""

from __future__ import annotations

from workflow_helpers import REPO

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
