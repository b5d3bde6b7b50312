"""``layer_norm``, the hidden-size ``nn.LayerNorm`` of Phi-3.5-MoE (transformers
``PhimoeDecoderLayer``, vLLM ``PhiMoEDecoderLayer``): the baseline equals the model's own
module, the module tree finds it (and no other vendored model has one), the manifest gives
it to Phi-3.5-MoE where ``rms_norm`` no longer stands in, and its inputs have per-row means
so a candidate that normalises without removing the mean (an RMSNorm) or without the bias
fails while the shipped ``var_mean_fp32`` passes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from operator_helpers import randn
from transformers import PhimoeConfig
from transformers.models.phimoe.modeling_phimoe import PhimoeDecoderLayer

from kb_nano.kernels.compare import compare, tolerance
from kb_nano.kernels.inputs import Refresher, randomize_constant_parameters
from kb_nano.kernels.manifest import generate
from kb_nano.models.configs import config_fields, resolve
from kb_nano.models.module_tree import read
from kb_nano.operators.base import make_tensor
from kb_nano.operators.norms import LayerNorm, RMSNorm

REPO = Path(__file__).resolve().parents[2]


def _candidate():
    path = REPO / "candidates" / "layer_norm" / "var_mean_fp32.py"
    spec = importlib.util.spec_from_file_location("layer_norm_var_mean", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.VarMeanLayerNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_baseline_equals_phimoe_input_layernorm(dtype):
    hf = PhimoeDecoderLayer(PhimoeConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4), 0)
    norm = hf.input_layernorm.to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
        norm.bias.normal_(0.0, 0.1)
    ours = LayerNorm(64, eps=norm.eps).to(dtype)
    ours.load_state_dict(norm.state_dict())
    x = randn(9, 64, dtype=dtype, seed=4) + 3.0
    x[0] = 0.0  # an all-zero row: the bias alone
    with torch.no_grad():
        torch.testing.assert_close(ours(x), norm(x), rtol=0, atol=0)
        torch.testing.assert_close(ours(x)[0], norm.bias.detach(), rtol=0, atol=0)


def test_module_tree_finds_phis_layer_norm_and_no_other_vendored_model_has_one():
    def tree(key):
        return read(config_fields(resolve(key, REPO), REPO))

    phi = tree("phi35-moe")
    assert (
        phi["layer_norm"] == {"class": "LayerNorm", "eps": 1e-5, "bias": True} and phi["hidden_norm"]["class"] is None
    )
    for key in ("llama31-8b", "gemma3-4b"):  # gemma3-4b: a multimodal config with a vision tower
        assert tree(key)["layer_norm"] is None, key


def test_manifest_gives_phi_layer_norm_and_no_rms_norm_stand_in():
    m = generate(
        ["phi35-moe", "llama31-8b"], [1], [8], "auto", REPO, targets=["layer_norm", "rms_norm", "fused_add_rms_norm"]
    )
    rows = {s["scenario_id"]: s for s in m["scenarios"]}
    s = rows["layer_norm__phi35-moe__tp1__n8"]
    assert s["applicable"] and s["init_args"] == {"hidden_size": 4096, "eps": 1e-5, "bias": True}
    assert s["inputs"][0]["init"] == {"dist": "normal", "std": 1.0, "row_mean_std": 2.0}
    for target in ("rms_norm", "fused_add_rms_norm"):
        assert rows[f"{target}__phi35-moe__tp1__n8"]["reason"] == f"PhiMoEForCausalLM does not use {target}"
        assert rows[f"{target}__llama31-8b__tp1__n8"]["applicable"]
    assert rows["layer_norm__llama31-8b__tp1__n8"]["reason"] == "LlamaForCausalLM does not use layer_norm"


def _timed_inputs(scenario: dict) -> torch.Tensor:
    """Four slots of the inputs the judge writes before a timed batch (its Refresher)."""
    (spec,) = scenario["inputs"]
    slots = [torch.empty(4, *spec["shape"], dtype=torch.bfloat16)]
    Refresher(scenario, slots, seed=7, golden=None, root=REPO, first_draw=0)(4)
    return slots[0]


@pytest.mark.parametrize("wrong", ["rms_norm", "no_bias"])
def test_inputs_have_row_means_so_an_rms_norm_or_a_missing_bias_fails(wrong):
    m = generate(["phi35-moe"], [1], [64], "auto", REPO, targets=["layer_norm"])
    (s,) = m["scenarios"]
    trial = make_tensor(s["inputs"][0], torch.Generator().manual_seed(0), "cpu")
    timed = _timed_inputs(s)
    for x in (trial, *timed):  # the correctness trials' draws and the timed calls' slots
        assert x.float().mean(-1).std() > 1.0  # rows have their own means
    base = LayerNorm(**s["init_args"]).to(torch.bfloat16)
    randomize_constant_parameters(base, seed=1)  # as the judge does: the bias is not zero
    good = _candidate()(**s["init_args"]).to(torch.bfloat16)
    good.load_state_dict(base.state_dict())
    bad = RMSNorm(4096, eps=1e-5) if wrong == "rms_norm" else LayerNorm(4096, eps=1e-5, bias=False)
    bad = bad.to(torch.bfloat16)
    bad.weight.data.copy_(base.weight.data)
    atol, rtol = tolerance(s, {})
    with torch.no_grad():
        for x in (trial, timed[0]):
            ref = base(x)
            assert compare(ref, good(x), atol, rtol)[0] == "passed"
            assert compare(ref, bad(x), atol, rtol)[0] == "incorrect"
