"""Helpers of the Tier-1 engine tests (test_measure_rows, test_measure_operators,
test_candidate_loading, ...): one judged measurement with the module's worker pool, tiny model
configs, candidate files written from source, rms_norm candidates per status and the row check."""

from __future__ import annotations

import textwrap
from pathlib import Path

from kb_nano.kernels.schema import COLUMNS, STATUSES

# the module's worker pool, set by the ``_worker_pool`` fixture (conftest.py)
_POOL: dict = {}


def measure(scenario, candidate_id, path, settings, root, logs: list | None = None):
    """One judged measurement with the module's pool (see kb_nano.kernels.measure.measure);
    the job log's text is appended to ``logs`` when given. Raises RuntimeError when the
    calling module does not use the ``_worker_pool`` fixture."""
    import tempfile

    if "pool" not in _POOL:
        raise RuntimeError('measure needs the pool: add pytestmark = pytest.mark.usefixtures("_worker_pool")')

    from kb_nano.kernels.measure import measure as judged

    with tempfile.TemporaryFile() as log:
        row = judged(
            scenario, candidate_id, Path(path), {"seed": None, **settings}, Path(root), _POOL["pool"], log.fileno()
        )
        if logs is not None:
            log.seek(0)
            logs.append(log.read().decode(errors="replace"))
        return row


# A tiny Llama for operators whose real shapes are too big for a unit test (the
# embedding of llama32-1b is 128256 x 2048).
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 1,
    "vocab_size": 1000,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# Tiny Qwen3-MoE (qk_norm, fused_moe) and Gemma-2 (gelu_and_mul, soft-capped attention).
TINY_QWEN3_MOE = {
    **{k: v for k, v in TINY_CONFIG.items() if k != "rope_scaling"},
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "rope_theta": 1000000.0,
}
TINY_GEMMA2 = {
    **{k: v for k, v in TINY_CONFIG.items() if k != "rope_scaling"},
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 16,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "sliding_window": 128,
    "rope_theta": 10000.0,
    "num_hidden_layers": 2,  # one sliding and one global layer
}


# Small dims over the vendored Phi-3.5-MoE (layer_norm, sparsemixer fused_moe) and gpt-oss
# (swigluoai_and_mul) configs (conftest.py merges them): rope scaling dropped, whose factor
# lists are sized for the real head_dim.
TINY_PHIMOE = {
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "num_local_experts": 4,
    "vocab_size": 1000,
    "pad_token_id": 0,
    "max_position_embeddings": 256,
    "original_max_position_embeddings": 256,
    "rope_scaling": None,
}
TINY_GPT_OSS = {
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "num_local_experts": 4,
    "vocab_size": 1000,
    "pad_token_id": 0,
    "max_position_embeddings": 256,
    "rope_scaling": None,
}


def write(path: Path, source: str) -> Path:
    """Write ``source`` (dedented) to ``path``, creating its folders; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def check_row(row: dict, status: str, candidate_id: str | None = None) -> dict:
    """Assert that ``row`` has every result column and ``status`` (a one-line error unless
    passed) and, when given, ``candidate_id``; returns ``row``."""
    assert set(row) == set(COLUMNS)
    assert row["status"] == status, (row["status"], row["error"])
    assert row["status"] in STATUSES
    if status == "passed":
        assert row["error"] is None
    else:
        assert isinstance(row["error"], str) and row["error"], row
        assert "\n" not in row["error"], row["error"]
    if candidate_id:
        assert row["candidate"] == candidate_id
    return row


# --------------------------------------------------------------------------- measure

RMS_TEMPLATE = """
import math
import torch
import torch.nn.functional as F
from torch import nn


class Cand(nn.Module):
    {class_attrs}

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        {extra_init}

    def forward(self, x, residual=None):
        {forward}
"""

# name -> (expected status, forward body, extra __init__ line, class attributes)
RMS_CANDIDATES = {
    "good": (
        "passed",
        "return F.rms_norm(x.float(), (self.hidden_size,), None, self.variance_epsilon).to(x.dtype) * self.weight",
    ),
    "raises": ("runtime_error", "raise RuntimeError('boom\\nat line two')"),
    "nan": ("nonfinite", "return torch.full_like(x, math.nan)"),
    "shape": ("incorrect_shape", "return x[:, :-1].clone()"),
    "dtype": (
        "incorrect_dtype",
        "return F.rms_norm(x.float(), (self.hidden_size,), self.weight.float(), self.variance_epsilon)",
    ),
    "wrong": ("incorrect", "return x * self.weight"),
    # right only while the weight is all ones: measure must randomise it
    "ignores_weight": (
        "incorrect",
        "return F.rms_norm(x.float(), (self.hidden_size,), None, self.variance_epsilon).to(x.dtype)",
    ),
    "cuda_only": ("skipped", "raise AssertionError('must not run on the CPU')", "", "supported_devices = ('cuda',)"),
    "extra_key": ("import_error", "return x", "self.bias = nn.Parameter(torch.zeros(hidden_size))"),
}


def rms_candidate(tmp_path: Path, name: str) -> Path:
    """Write the rms_norm candidate ``name`` of :data:`RMS_CANDIDATES` under
    ``tmp_path/candidates/rms_norm/``; returns its path."""
    _, forward, *rest = RMS_CANDIDATES[name]
    extra_init, class_attrs = (list(rest) + ["", ""])[:2]
    source = RMS_TEMPLATE.format(forward=forward, extra_init=extra_init or "pass", class_attrs=class_attrs or "pass")
    return write(tmp_path / "candidates/rms_norm" / f"{name}.py", source)


def job_settings(settings: dict, **more) -> dict:
    """The ``settings`` fixture completed to what :func:`kb_nano.kernels.job.run` takes (the
    rule's full settings: OS-drawn seed, no golden inputs, eager only), with ``more`` on top."""
    full = {
        **settings,
        "seed": None,
        "golden": None,
        "num_trials": 3,
        "cuda_graph": False,
        "float32_matmul_precision": "highest",
        "memory_limit_gb": None,
        "roofline": None,
    }
    return {**full, **more}
