"""Attention sinks (gpt-oss): the module tree finds and probes them, the baseline equals
transformers' gpt-oss eager attention on a sliding and a full layer, the manifest gives
gpt-oss scenarios per layer kind with the ``sinks`` semantics, and a kernel without
sinks fails them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kb_nano.kernels.inputs import make_inputs
from kb_nano.kernels.manifest import generate
from kb_nano.kernels.measure import measure_once
from kb_nano.models.configs import config_fields, resolve
from kb_nano.models.module_tree import read
from kb_nano.operators.attention import Attention

REPO = Path(__file__).resolve().parents[2]
# the vendored gpt-oss-20b config at small dims: 4 query heads in 2 KV groups, head_dim 16,
# a window of 5, two layers (layer_types: sliding, full)
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
SMALL.update(num_hidden_layers=2, sliding_window=5, intermediate_size=32, num_local_experts=2, vocab_size=128)


def _small_gpt_oss_attention(layer_idx: int):
    """``GptOssAttention`` of layer ``layer_idx`` (0: sliding, 1: full) of the vendored
    config at :data:`SMALL` dims, on the CPU in float32, with N(0, 2^2) sinks."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    from kb_nano.operators.hf_modules import hf_config

    fields = {**config_fields(resolve("gpt-oss-20b", REPO), REPO), **SMALL}
    fields["layer_types"] = fields["layer_types"][:2]
    module = GptOssAttention(hf_config(fields), layer_idx).eval()
    with torch.no_grad():
        module.sinks.copy_(torch.randn(4, generator=torch.Generator().manual_seed(1)) * 2)
    return module


def _transformers(module, q, k, v, q_positions, n_keys):
    """transformers' gpt-oss ``eager_attention_forward`` of ``module`` on ``[B, heads, S,
    d]`` tensors, with the additive mask its eager path builds (0 where the causal or
    sliding-window mask function allows the key, the dtype's minimum elsewhere)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    window = module.sliding_window
    allowed = sliding_window_causal_mask_function(window) if window else causal_mask_function
    zero = torch.tensor(0)
    ok = allowed(zero, zero, torch.tensor(list(q_positions))[:, None], torch.arange(n_keys)[None, :])
    mask = torch.zeros(ok.shape, dtype=q.dtype).masked_fill(~ok, torch.finfo(q.dtype).min)
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=module.scaling, dropout=0.0)
    return out


EDGE = {
    "random": lambda t: t,
    "large": lambda t: t * 8,  # logits of ~64 x the variance: one key takes (almost) all mass
    "tiny": lambda t: t * 1e-3,  # uniform attention: the sink's share is e^s / (e^s + keys)
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer_idx", [0, 1], ids=["sliding", "full"])
@pytest.mark.parametrize("case", list(EDGE))
def test_sinks_baseline_equals_transformers_gpt_oss_eager_attention(layer_idx, dtype, case):
    module = _small_gpt_oss_attention(layer_idx)
    assert (module.sliding_window == 5) is (layer_idx == 0)
    h, kv, d, n, ctx = 4, 2, 16, 12, 9
    ours = Attention(h, d, module.scaling, kv, per_layer_sliding_window=module.sliding_window, sinks=True)
    assert dict(ours.state_dict()).keys() == {"sinks"} and ours.sinks.shape == (h,)
    with torch.no_grad():
        ours.sinks.copy_(module.sinks)
        if case == "large":  # a sink far above and one far below every logit
            ours.sinks[0], ours.sinks[1] = 30.0, -30.0
            module.sinks.copy_(ours.sinks)
    module, ours = module.to(dtype), ours.to(dtype)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (EDGE[case](torch.randn(n, w * d, generator=gen)).to(dtype) for w in (h, kv, kv))
    q[3] = 0  # a zero query row: uniform logits over its keys
    with torch.no_grad():
        got = ours(q, k, v)
        ref = _transformers(module, *(t.view(1, n, -1, d).transpose(1, 2) for t in (q, k, v)), range(n), n)
        assert torch.equal(got, ref.reshape(n, h * d)), (got.float() - ref.reshape(n, h * d).float()).abs().max()
        # decode: each of n sequences has ctx cached keys; its new token sits at position ctx
        kc, vc = (EDGE[case](torch.randn(n, ctx, kv, d, generator=gen)).to(dtype) for _ in range(2))
        got = ours(q, k, v, kc, vc)
        keys = torch.cat((kc, k.view(n, 1, kv, d)), 1).transpose(1, 2)
        values = torch.cat((vc, v.view(n, 1, kv, d)), 1).transpose(1, 2)
        ref = _transformers(module, q.view(n, 1, h, d).transpose(1, 2), keys, values, [ctx], ctx + 1)
        assert torch.equal(got, ref.reshape(n, h * d)), (got.float() - ref.reshape(n, h * d).float()).abs().max()


def test_gpt_oss_attention_kinds_have_sinks_and_a_sinks_module_of_other_math_is_not_covered(monkeypatch):
    layers = read(config_fields(resolve("gpt-oss-20b", REPO), REPO))["attention_layers"]
    assert layers == {
        "kinds": [
            {"scale": 0.125, "sliding_window": 128, "logits_soft_cap": None, "sinks": True, "layers": 12},
            {"scale": 0.125, "sliding_window": None, "logits_soft_cap": None, "sinks": True, "layers": 12},
        ],
        "reason": None,
    }
    # the sinks are probed against the model's own eager attention: one that ignores them
    # (Llama's) is not the semantics the baseline computes
    import transformers.models.gpt_oss.modeling_gpt_oss as gpt_oss
    from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager

    monkeypatch.setattr(gpt_oss, "eager_attention_forward", llama_eager)
    other = read(config_fields(resolve("gpt-oss-20b", REPO), REPO))
    assert other["attention_layers"] == {
        "kinds": [],
        "reason": "not covered: GptOssAttention has sinks that compute other than the extra softmax column of gpt-oss",
    }


def test_gpt_oss_gets_attention_scenarios_per_layer_kind_with_sinks():
    m = generate(["gpt-oss-20b"], [1, 8], [4], "auto", REPO, targets=["attention"], context_lens=[16])
    by_id = {s["scenario_id"]: s for s in m["scenarios"]}
    assert sorted(by_id) == sorted(
        f"attention__gpt-oss-20b__tp{tp}__n4{ctx}__{kind}"
        for tp in (1, 8)
        for ctx in ("", "__ctx16", "__ctx256")
        for kind in ("sliding128", "full")
    )
    sliding, full = by_id["attention__gpt-oss-20b__tp8__n4__sliding128"], by_id["attention__gpt-oss-20b__tp8__n4__full"]
    assert sliding["semantics"] == "sliding_window+sinks" and full["semantics"] == "sinks"
    assert sliding["init_args"] == {
        "num_heads": 8,  # 64 heads split over 8 ranks, and the sinks with them
        "head_size": 64,
        "scale": 0.125,
        "num_kv_heads": 1,
        "logits_soft_cap": None,
        "per_layer_sliding_window": 128,
        "sinks": True,
    }
    assert "per_layer_sliding_window" not in full["init_args"] and full["init_args"]["sinks"] is True
    assert by_id["attention__gpt-oss-20b__tp1__n4__full"]["init_args"]["num_heads"] == 64
    with torch.device("meta"):
        assert Attention(**full["init_args"]).state_dict()["sinks"].shape == (8,)


@pytest.mark.parametrize("kind", ["sliding128", "full"])
@pytest.mark.parametrize("variant", ["", "__ctx256"])
def test_the_sink_takes_a_real_share_so_a_kernel_without_it_fails(kind, variant):
    m = generate(["gpt-oss-20b"], [8], [16], "auto", REPO, targets=["attention"])
    (scenario,) = [
        s for s in m["scenarios"] if s["scenario_id"] == f"attention__gpt-oss-20b__tp8__n16{variant}__{kind}"
    ]
    values, _ = make_inputs(scenario, torch.Generator().manual_seed(0), "cpu", None, REPO, draw=0)
    names = [spec["name"] for spec in scenario["inputs"]]
    args = scenario["init_args"]
    torch.manual_seed(0)
    baseline = Attention(**args).to(torch.bfloat16)
    without = Attention(**{**args, "sinks": False}).to(torch.bfloat16)
    with torch.no_grad():
        ref, out = baseline(*values).float(), without(*values).float()
        # the sinks take a real share of the probability mass: with values of ones the
        # output is each (token, head) row's mass outside the sink, 1 - its share
        ones = [
            torch.ones_like(t, dtype=torch.float32) if name in ("value", "value_cache") else t.float()
            for name, t in zip(names, values)
        ]
        share = 1 - baseline.float()(*ones).view(16, 8, 64)[..., 0]
        real = ((share > 0.1) & (share < 0.9)).float().mean()
        assert real >= 0.15 and share.max() > 0.9, share
        # ... so a kernel without them is far outside the tolerance
        atol, rtol = scenario["atol"], scenario["rtol"]
        assert ((out - ref).abs() - (atol + rtol * ref.abs())).max() > 0.1


SINKLESS = """
import torch
from torch import nn


class Sinkless(nn.Module):
    supported_semantics = ({semantics})

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, logits_soft_cap=None,
                 per_layer_sliding_window=None, prefix="", sinks=False):
        super().__init__()
        self.h, self.d, self.scale, self.kv = num_heads, head_size, scale, num_kv_heads or num_heads
        self.window = per_layer_sliding_window
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None

    def forward(self, query, key, value, key_cache=None, value_cache=None):
        # causal (windowed) attention that reads the sinks but leaves them out of the softmax
        n, d = query.shape[0], self.d
        q = query.view(n, self.h, d).transpose(0, 1)
        k = key.view(n, self.kv, d).transpose(0, 1).repeat_interleave(self.h // self.kv, 0)
        v = value.view(n, self.kv, d).transpose(0, 1).repeat_interleave(self.h // self.kv, 0)
        pos = torch.arange(n)
        ahead = pos[:, None] - pos[None, :]
        mask = (ahead < 0) | (ahead >= self.window) if self.window else ahead < 0
        s = (q @ k.transpose(1, 2) * self.scale).masked_fill(mask, float("-inf"))
        p = torch.softmax(s, -1, dtype=torch.float32).to(query.dtype)
        return (p @ v).transpose(0, 1).reshape(n, self.h * d)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("candidate", "semantics", "statuses"),
    [
        ("gqa_grouped", None, {"sliding128": "passed", "full": "passed"}),
        ("sinkless", "'sliding_window', 'sinks'", {"sliding128": "incorrect", "full": "incorrect"}),
        ("sinkless", "'sliding_window',", {"sliding128": "skipped", "full": "skipped"}),
    ],
)
def test_candidates_run_sink_scenarios_only_when_declared_and_pass_only_with_sinks(
    tmp_path, candidate, semantics, statuses
):
    m = generate(["gpt-oss-20b"], [8], [4], "auto", REPO, targets=["attention"], context_lens=[])
    if semantics is None:
        path = REPO / "candidates/attention/gqa_grouped.py"
    else:
        path = tmp_path / "sinkless.py"
        path.write_text(SINKLESS.replace("{semantics}", semantics))
    settings = {"device": "cpu", "atol": None, "rtol": None, "num_warmup": 1, "num_runs": 3, "num_threads": 1}
    for scenario in m["scenarios"]:
        kind = scenario["layer_kind"]
        row = measure_once(scenario, f"attention/{candidate}", path, {**settings, "timeout_s": 120}, REPO)
        assert row["status"] == statuses[kind], (kind, row["error"])
        if statuses[kind] == "skipped":
            assert "does not list 'sinks' in supported_semantics" in row["error"], row["error"]
            assert "sink logit" in row["error"]


def test_kernels_list_shows_the_sinks_in_the_attention_contract_of_gpt_oss():
    from kb_nano import operators
    from kb_nano.operators.listing import ModelExamples, state_dict_text

    attention = operators.get("attention")
    assert (
        state_dict_text(attention, ModelExamples(REPO, ["gpt-oss-20b"], [1, 8])) == "of gpt-oss-20b tp=1:\nsinks [64]"
    )
    assert state_dict_text(attention, ModelExamples(REPO, ["llama31-8b"], [1])) == "(none)"
