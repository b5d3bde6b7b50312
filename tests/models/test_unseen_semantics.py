"""Configs outside the vendored set that kb-nano once refused or misread: fields under the
names of a config class's ``attribute_map`` (GPT-2's ``n_embd``, MPT's ``d_model``), q/k
norms not called ``q_norm``/``k_norm`` (Lfm2, HunYuan, Persimmon), the exact GELU of a
gated MLP, the gate of an MLP named ``w1``/``w3`` (Lfm2), and a rotary module without rope
parameters. Each baseline it now measures them with is checked equal to transformers'."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as hf
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.errors import KbNanoError
from kb_nano.kernels.manifest import generate
from kb_nano.models.configs import ModelRef, check_config_file
from kb_nano.models.module_tree import read
from kb_nano.operators.base import NotApplicable

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=128)


def _rows(tmp_path, config, targets=None) -> dict:
    """The manifest's scenarios of ``config`` (written as its config.json under ``tmp_path``)
    by target: ``(applicable, reason, init_args)`` of the first of each."""
    folder = tmp_path / config.model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_diff_dict() | {"model_type": config.model_type}))
    m = generate([str(folder)], [1], [4], "auto", REPO, context_lens=[16], targets=targets)
    rows = {}
    for s in m["scenarios"]:
        rows.setdefault(s["target"], (s["applicable"], s["reason"], s.get("init_args")))
    return rows


ALIASED = {
    "gpt2": lambda: hf.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=128, n_positions=256),
    "bloom": lambda: hf.BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=128),
    "mpt": lambda: hf.MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=128, max_seq_len=256),
    "dbrx": lambda: hf.DbrxConfig(
        d_model=64, n_heads=4, n_layers=2, vocab_size=128, max_seq_len=256,
        attn_config={"kv_n_heads": 2, "rope_theta": 5e5}, ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(ALIASED))
def test_configs_under_attribute_map_names_get_their_rows(tmp_path, kind):
    """GPT-2, Bloom, MPT and DBRX name hidden_size / heads / layers / positions otherwise
    (``n_embd``, ``n_head``, ``d_model``, ``n_positions``, ``max_seq_len``): read through
    the config object they are measured (a KeyError or a refusal before); Bloom and MPT
    have no position limit (ALiBi)."""
    rows = _rows(tmp_path, ALIASED[kind]())
    for target in ("layer_norm", "embedding", "lm_head", "sampler"):
        assert rows[target][0], (target, rows[target][1])
    assert rows["layer_norm"][2]["hidden_size"] == 64 and rows["embedding"][2]["num_embeddings"] == 128
    assert not rows["attention"][0]
    if kind == "gpt2":  # its q/k/v projection is a Conv1D, its MLP has no gate
        assert "GPT2Attention has c_attn (Conv1D), c_proj (Conv1D)" in rows["attention"][1]
        assert rows["mlp"][1] == "not covered: GPT2MLP is not gated (down(act(up(x))), no gate_proj)"
        assert rows["gelu_and_mul"][1] == "GPT2Config does not use gelu_and_mul"  # (gelu_new, ungated)
    if kind in ("bloom", "mpt"):
        assert "ALiBi" in rows["attention"][1]


def test_the_cheap_config_check_reads_attribute_map_names(tmp_path):
    """The workflow's parse-time check accepts GPT-2's own field names, and checks their values."""
    fields = hf.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=128).to_diff_dict() | {"model_type": "gpt2"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    ref = ModelRef("gpt2", None, path)
    check_config_file(ref, tmp_path)
    path.write_text(json.dumps(fields | {"n_embd": -4}))
    with pytest.raises(KbNanoError, match="field 'n_embd' is -4; expected a positive integer"):
        check_config_file(ref, tmp_path)


QK_LAYERNORM = {
    "lfm2": lambda: hf.Lfm2Config(**TINY, intermediate_size=128, layer_types=["full_attention", "conv"]),
    "hunyuan_v1_dense": lambda: hf.HunYuanDenseV1Config(**TINY, intermediate_size=128, head_dim=16),
    "persimmon": lambda: hf.PersimmonConfig(**TINY, intermediate_size=128, qk_layernorm=True),
}


@pytest.mark.parametrize("kind", sorted(QK_LAYERNORM))
def test_q_k_norms_named_layernorm_are_found(tmp_path, kind):
    """Lfm2's ``q_layernorm``/``k_layernorm`` and HunYuan's ``query_layernorm``/
    ``key_layernorm`` are per-head RMSNorms (``qk_norm`` measured, attention covered: both
    were "not covered: ... has k_layernorm"); Persimmon's are LayerNorms: not covered by the
    RMSNorm-based ``qk_norm``, its attention measured."""
    rows = _rows(tmp_path, QK_LAYERNORM[kind](), targets=["qk_norm", "attention"])
    assert rows["attention"][0], rows["attention"][1]
    if kind == "persimmon":
        assert rows["qk_norm"][1].startswith("not covered: LayerNorm computes neither")
        return
    assert rows["qk_norm"][0], rows["qk_norm"][1]
    assert rows["qk_norm"][2]["head_dim"] == 16 and rows["qk_norm"][2].get("weight_offset", 0.0) == 0.0


@pytest.mark.parametrize(
    ("cls", "where"),
    [("Lfm2RMSNorm", "lfm2.modeling_lfm2"), ("HunYuanDenseV1RMSNorm", "hunyuan_v1_dense.modeling_hunyuan_v1_dense")],
)
def test_qk_norm_baseline_equals_the_renamed_q_k_norms(cls, where):
    import importlib

    from kb_nano.operators.norms import QKNorm

    ref = getattr(importlib.import_module(f"transformers.models.{where}"), cls)(16, eps=1e-5)
    ours = QKNorm(4, 2, 16, 1e-5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, generator=gen))
        ours.q_norm.weight.copy_(ref.weight)
        ours.k_norm.weight.copy_(ref.weight)
        q, k = torch.randn(3, 64, generator=gen), torch.randn(3, 32, generator=gen)
        got_q, got_k = ours(q, k)
        torch.testing.assert_close(got_q, ref(q.view(3, 4, 16)).view(3, 64))
        torch.testing.assert_close(got_k, ref(k.view(3, 2, 16)).view(3, 32))


def test_an_exact_gelu_gated_mlp_is_measured_with_the_exact_gelu(tmp_path):
    """``hidden_act: gelu`` (transformers ``GELUActivation``: the erf GELU) in a gated MLP:
    ``gelu_and_mul`` with ``approximate="none"`` (no row before) and ``mlp`` with
    ``hidden_act="gelu"`` (not covered before), each equal to transformers' module; the
    tanh form stays ``approximate="tanh"``."""
    from transformers.models.llama.modeling_llama import LlamaMLP as HFLlamaMLP

    from kb_nano.operators.activations import GeluAndMul
    from kb_nano.operators.mlp import LlamaMLP

    config = hf.LlamaConfig(**TINY, intermediate_size=96, hidden_act="gelu")
    rows = _rows(tmp_path, config, targets=["gelu_and_mul", "mlp"])
    assert rows["gelu_and_mul"][2] == {"approximate": "none"}
    assert rows["mlp"][2]["hidden_act"] == "gelu"
    tanh = hf.LlamaConfig(**TINY, intermediate_size=96, hidden_act="gelu_pytorch_tanh").to_dict()
    assert operators.get("gelu_and_mul").init_args({**read(tanh), "intermediate_size": 96}, 1) == {
        "approximate": "tanh"
    }
    ref, ours = HFLlamaMLP(config), LlamaMLP(64, 96, "gelu")
    with torch.no_grad():
        ours.gate_up_proj.weight.copy_(torch.cat((ref.gate_proj.weight, ref.up_proj.weight)))
        ours.down_proj.weight.copy_(ref.down_proj.weight)
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)) * 3
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)
        gate_up = torch.cat((ref.gate_proj(x), ref.up_proj(x)), dim=-1)
        want = ref.act_fn(ref.gate_proj(x)) * ref.up_proj(x)
        torch.testing.assert_close(GeluAndMul("none")(gate_up), want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(GeluAndMul("tanh")(gate_up), want, rtol=1e-5, atol=1e-5)


def test_an_mlp_with_w1_w3_w2_is_read_as_gated_and_measured(tmp_path):
    """Lfm2's MLP computes ``w2(silu(w1(x)) * w3(x))``: the probe finds w1 the gate, w3 the
    up projection (it was "not gated" before), and ``mlp`` equals ``Lfm2MLP``; a module that
    swaps the roles is not read as gated."""
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    from kb_nano.models.ffn_tree import w123_activation
    from kb_nano.operators.mlp import LlamaMLP

    config = QK_LAYERNORM["lfm2"]()
    rows = _rows(tmp_path, config, targets=["mlp", "silu_and_mul"])
    assert rows["mlp"][0] and rows["silu_and_mul"][0], rows
    width = rows["mlp"][2]["intermediate_size"]
    ref = Lfm2MLP(config)
    assert width == ref.w1.out_features and rows["mlp"][2]["hidden_act"] == "silu"
    ours = LlamaMLP(64, width, "silu")
    with torch.no_grad():
        ours.gate_up_proj.weight.copy_(torch.cat((ref.w1.weight, ref.w3.weight)))
        ours.down_proj.weight.copy_(ref.w2.weight)
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)

    class Swapped(Lfm2MLP):  # w3 the gate
        def forward(self, x):
            return self.w2(torch.nn.functional.silu(self.w3(x)) * self.w1(x))

    assert w123_activation(ref) == "silu" and w123_activation(Swapped(config)) is None


def test_a_rotary_module_without_rope_parameters_says_so():
    """A model that builds a rotary module while its config has no rope parameters: the
    reason says that (it read "rope parameters per layer type ()"), naming NoPE switches."""
    op = operators.get("rotary_embedding")
    facts = {**TINY, "head_dim": 16, "rope": {"rope_type": "default"}, "rotary_module": True, "dtype": "float32"}
    facts |= {"partial_rotary_factor": 1.0, "max_position_embeddings": 256}
    with pytest.raises(NotApplicable) as info:
        op.init_args(facts, 1)
    assert "()" not in str(info.value) and "no rope parameters (no rope_theta)" in str(info.value)
    assert "NoPE" in str(info.value)
    facts["hf_config"] = {"no_rope_layers": [1, 0]}
    with pytest.raises(NotApplicable, match=r"NoPE layers \(no_rope_layers=\[1, 0\]\)"):
        op.init_args(facts, 1)
    facts["rope"] = {"rope_type": "default", "full_attention": {"rope_theta": 1e4}}
    with pytest.raises(NotApplicable, match=r"per layer type \(full_attention\)"):
        op.init_args(facts, 1)
