"""Llama-4's attention: chunked layers (a query sees the earlier keys of its own chunk)
equal transformers' eager attention under its chunked causal mask, decode agrees with
prefill across a chunk boundary, Scout's scenarios carry the kind, and candidates run
those scenarios only when they declare ``chunked_attention`` and pass only with the
chunks; the weightless q/k norm (``qk_norm``, semantics ``no_weight``) equals
``Llama4TextL2Norm``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from operator_helpers import measure_cpu, randn
from transformers.masking_utils import chunked_causal_mask_function
from transformers.models.llama.modeling_llama import eager_attention_forward
from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm
from workflow_helpers import REPO

from kb_nano.kernels.manifest import generate
from kb_nano.operators.attention import Attention
from kb_nano.operators.norms import QKNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_prefill_equals_transformers_eager_under_its_chunked_mask(dtype):
    n, h, kv, d, chunk = 11, 4, 2, 64, 4
    q, k, v = (randn(n, w * d, dtype=dtype, seed=i) for i, w in ((1, h), (2, kv), (3, kv)))
    out = Attention(h, d, d**-0.5, kv, attention_chunk_size=chunk)(q, k, v)
    pos = torch.arange(n)
    visible = chunked_causal_mask_function(chunk, torch.zeros(1, dtype=torch.long))(0, 0, pos[:, None], pos[None, :])
    mask = torch.zeros(n, n, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]
    want, _ = eager_attention_forward(
        SimpleNamespace(num_key_value_groups=h // kv, training=False),
        *(t.view(1, n, -1, d).transpose(1, 2) for t in (q, k, v)),
        mask,
        scaling=d**-0.5,
    )
    torch.testing.assert_close(out, want.reshape(n, h * d), rtol=0, atol=0)
    # the first token of each chunk sees only itself: its output is its own value
    for i in (0, 4, 8):
        torch.testing.assert_close(out[i].view(kv, h // kv, d), v[i].view(kv, 1, d).expand(kv, h // kv, d))


def test_chunked_decode_agrees_with_prefill_across_a_chunk_boundary():
    n, h, kv, d, chunk = 11, 4, 2, 64, 4
    attn = Attention(h, d, d**-0.5, kv, attention_chunk_size=chunk)
    q, k, v = randn(n, h * d, seed=1), randn(n, kv * d, seed=2), randn(n, kv * d, seed=3)
    prefill = attn(q, k, v)
    for last in (3, 4, 7, 10):  # the query at position `last`, its cache the tokens before it
        cache_k, cache_v = k[:last].view(1, last, kv, d), v[:last].view(1, last, kv, d)
        decode = attn(q[last : last + 1], k[last : last + 1], v[last : last + 1], cache_k, cache_v)
        torch.testing.assert_close(decode, prefill[last : last + 1], rtol=1e-5, atol=1e-6)


def test_llama4_scout_scenarios_carry_the_chunked_kind_and_the_weightless_norm():
    m = generate(["llama4-scout"], [8], [4], "auto", REPO, targets=["attention", "qk_norm"], context_lens=[16])
    rows = {s["scenario_id"]: s for s in m["scenarios"]}
    assert sorted(rows) == [
        "attention__llama4-scout__tp8__n4__chunked8192",
        "attention__llama4-scout__tp8__n4__ctx12288__chunked8192",
        "attention__llama4-scout__tp8__n4__ctx12288__full",
        "attention__llama4-scout__tp8__n4__ctx16__chunked8192",
        "attention__llama4-scout__tp8__n4__ctx16__full",
        "attention__llama4-scout__tp8__n4__ctx8192__chunked8192",
        "attention__llama4-scout__tp8__n4__ctx8192__full",
        "attention__llama4-scout__tp8__n4__full",
        "qk_norm__llama4-scout__tp8__n4__no_weight",
    ]
    chunked = rows["attention__llama4-scout__tp8__n4__ctx12288__chunked8192"]
    assert chunked["semantics"] == "chunked_attention" and chunked["init_args"]["attention_chunk_size"] == 8192
    assert "attention_chunk_size" not in rows["attention__llama4-scout__tp8__n4__full"]["init_args"]
    norm = rows["qk_norm__llama4-scout__tp8__n4__no_weight"]
    assert norm["init_args"]["has_weight"] is False and [i["shape"] for i in norm["inputs"]] == [[4, 640], [4, 128]]


def test_weightless_qk_norm_equals_llama4_l2_norm_per_head():
    heads, kv, d = 5, 1, 128
    q, k = randn(3, heads * d, dtype=torch.bfloat16, seed=1), randn(3, kv * d, dtype=torch.bfloat16, seed=2)
    norm = QKNorm(heads, kv, d, 1e-5, has_weight=False)
    assert norm.state_dict() == {}
    got_q, got_k = norm(q, k)
    l2 = Llama4TextL2Norm(1e-5)
    torch.testing.assert_close(got_q, l2(q.view(3, heads, d)).view(q.shape), rtol=0, atol=0)
    torch.testing.assert_close(got_k, l2(k.view(3, kv, d)).view(k.shape), rtol=0, atol=0)


CHUNKLESS = """
import torch
from torch import nn


class Chunkless(nn.Module):
    supported_semantics = ({semantics})

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, logits_soft_cap=None,
                 per_layer_sliding_window=None, prefix="", sinks=False, attention_chunk_size=None):
        super().__init__()
        self.h, self.d, self.scale, self.kv = num_heads, head_size, scale, num_kv_heads or num_heads

    def forward(self, query, key, value, key_cache=None, value_cache=None):
        # causal attention over every earlier key: the chunks ignored
        n, d, g = query.shape[0], self.d, self.h // self.kv
        q = query.view(n, self.h, 1, d)
        k = torch.cat((key_cache, key.view(n, 1, self.kv, d)), 1).transpose(1, 2).repeat_interleave(g, 1)
        v = torch.cat((value_cache, value.view(n, 1, self.kv, d)), 1).transpose(1, 2).repeat_interleave(g, 1)
        p = torch.softmax(q @ k.transpose(2, 3) * self.scale, -1, dtype=torch.float32).to(query.dtype)
        return (p @ v).reshape(n, self.h * d)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("candidate", "semantics", "status"),
    [
        ("gqa_grouped", None, "passed"),
        ("chunkless", "'chunked_attention',", "incorrect"),
        ("chunkless", "", "skipped"),
    ],
)
def test_candidates_run_chunked_scenarios_only_when_declared_and_pass_only_with_chunks(
    tmp_path, candidate, semantics, status
):
    m = generate(["llama4-scout"], [8], [2], "auto", REPO, targets=["attention"], context_lens=[16])
    (scenario,) = [s for s in m["scenarios"] if s["scenario_id"].endswith("__ctx12288__chunked8192")]
    if semantics is None:
        path = REPO / "candidates/attention/gqa_grouped.py"
    else:
        path = tmp_path / "chunkless.py"
        path.write_text(CHUNKLESS.replace("{semantics}", semantics))
    row = measure_cpu(scenario, f"attention/{candidate}", path)
    assert row["status"] == status, row["error"]
    if status == "skipped":
        assert "does not list 'chunked_attention' in supported_semantics" in row["error"], row["error"]
        assert "ChunkedLocalAttention" in row["error"], row["error"]


@pytest.mark.slow
def test_a_chunk_starting_one_key_late_fails_at_the_chunk_boundary(tmp_path):
    """``>`` for ``>=`` in the decode's chunk test: wrong only when the query is the first
    of its chunk (ctx = C), where it must see only itself."""
    shipped = (REPO / "candidates/attention/gqa_grouped.py").read_text()
    assert "if self.chunk and c >= self.chunk:" in shipped
    path = tmp_path / "late_chunk.py"
    path.write_text(shipped.replace("if self.chunk and c >= self.chunk:", "if self.chunk and c > self.chunk:"))
    m = generate(["llama4-scout"], [8], [2], "auto", REPO, targets=["attention"], context_lens=[16])
    rows = {s["scenario_id"]: s for s in m["scenarios"]}
    for suffix, status in (("ctx8192__chunked8192", "incorrect"), ("ctx12288__chunked8192", "passed")):
        row = measure_cpu(rows[f"attention__llama4-scout__tp8__n2__{suffix}"], "attention/late_chunk", path)
        assert row["status"] == status, (suffix, row["error"])


@pytest.mark.slow
def test_the_shipped_qk_norm_candidate_passes_the_weightless_norm():
    m = generate(["llama4-scout"], [8], [4], "auto", REPO, targets=["qk_norm"])
    (scenario,) = m["scenarios"]
    row = measure_cpu(scenario, "qk_norm/fused_rms", REPO / "candidates/qk_norm/fused_rms.py")
    assert row["status"] == "passed", row["error"]
