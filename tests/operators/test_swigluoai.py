"""gpt-oss's clamped SwiGLU as its own L1 target, ``swigluoai_and_mul`` (vLLM
``SwigluOAIAndMul``): the baseline equals transformers' ``GptOssExperts._apply_gate``, the
manifest gives it to gpt-oss (and ``silu_and_mul`` no longer stands in), its inputs reach
the clamp, and a candidate without the clamp, with another alpha or with the gate/up
halves instead of interleaved columns fails while the shipped in-place one passes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from operator_helpers import randn
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from kb_nano.kernels.compare import compare, tolerance
from kb_nano.kernels.manifest import generate
from kb_nano.operators.activations import SWIGLUOAI_INPUT_STD, SwigluOAIAndMul
from kb_nano.operators.base import make_tensor

REPO = Path(__file__).resolve().parents[2]


def _candidate(name: str):
    path = REPO / "candidates" / "swigluoai_and_mul" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"swigluoai_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_baseline_equals_transformers_gpt_oss_experts_gate(dtype):
    experts = GptOssExperts(GptOssConfig(hidden_size=64, intermediate_size=48, num_local_experts=4))
    x = randn(7, 2 * 48, dtype=dtype, seed=3, std=SWIGLUOAI_INPUT_STD)
    x[0, :8] = torch.tensor([-50.0, -50.0, 50.0, 50.0, 7.0, -7.0, 0.0, 0.0])  # past and at the limits
    want = experts._apply_gate(x)
    got = SwigluOAIAndMul(experts.alpha, experts.limit)(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_manifest_gives_gpt_oss_its_own_activation_and_no_silu_stand_in():
    m = generate(
        ["gpt-oss-20b", "qwen3-30b-a3b"], [4], [64], "auto", REPO, targets=["swigluoai_and_mul", "silu_and_mul"]
    )
    rows = {s["scenario_id"]: s for s in m["scenarios"]}
    s = rows["swigluoai_and_mul__gpt-oss-20b__tp4__n64"]
    assert s["applicable"] and s["init_args"] == {"alpha": 1.702, "limit": 7.0}
    # vLLM's fused_experts: num_tokens * top_k rows of one expert's TP-sharded width (2880 / 4)
    assert s["inputs"] == [
        {"name": "x", "shape": [64 * 4, 2 * 720], "dtype": "bfloat16", "init": {"dist": "normal", "std": 4.0}}
    ]
    assert rows["silu_and_mul__gpt-oss-20b__tp4__n64"]["reason"] == "GptOssForCausalLM does not use silu_and_mul"
    qwen = rows["swigluoai_and_mul__qwen3-30b-a3b__tp4__n64"]
    assert not qwen["applicable"] and qwen["reason"] == "Qwen3MoeForCausalLM does not use swigluoai_and_mul"
    assert rows["silu_and_mul__qwen3-30b-a3b__tp4__n64"]["applicable"]


def _unclamped(x, alpha=1.702, limit=7.0):
    gate, up = x[..., ::2], x[..., 1::2]
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def _halves(x, alpha=1.702, limit=7.0):
    d = x.shape[-1] // 2
    return SwigluOAIAndMul(alpha, limit)(torch.stack((x[..., :d], x[..., d:]), dim=-1).flatten(-2))


@pytest.mark.parametrize(
    "wrong", [_unclamped, lambda x, a, lim: SwigluOAIAndMul(1.0, lim)(x), _halves], ids=["no_clamp", "alpha", "halves"]
)
def test_drawn_inputs_reach_the_clamp_and_wrong_semantics_fail(wrong):
    m = generate(["gpt-oss-20b"], [4], [16], "auto", REPO, targets=["swigluoai_and_mul"])
    (s,) = m["scenarios"]
    x = make_tensor(s["inputs"][0], torch.Generator().manual_seed(0), "cpu")
    gate, up = x[:, ::2].float(), x[:, 1::2].float()
    assert 0.03 < (gate > 7).float().mean() < 0.1 and 0.05 < (up.abs() > 7).float().mean() < 0.15
    ref = SwigluOAIAndMul(**s["init_args"])(x)
    atol, rtol = tolerance(s, {})
    assert compare(ref, _candidate("inplace").InplaceSwigluOAIAndMul(**s["init_args"])(x), atol, rtol)[0] == "passed"
    assert compare(ref, wrong(x, 1.702, 7.0), atol, rtol)[0] == "incorrect"
