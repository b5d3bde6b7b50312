"""The newer L1 operators (gelu_and_mul, qk_norm, lm_head, sampler): each baseline equals its
transformers reference on random inputs, the rules give per-rank shapes, ``applies_to``
follows the architecture.

References: transformers ``ACT2FN["gelu_pytorch_tanh"]`` / ``Gemma2MLP``, ``Qwen3RMSNorm``
as ``Qwen3Attention`` applies it, ``LlamaForCausalLM.lm_head``, ``TopKLogitsWarper`` +
``TopPLogitsWarper``.
"""

from __future__ import annotations

import pytest
import torch
from operator_helpers import MODELS, randn, shapes
from transformers import (
    Gemma2Config,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.activations import ACT2FN
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from kb_nano import operators
from kb_nano.operators.activations import GeluAndMul
from kb_nano.operators.base import NotApplicable, make_tensor
from kb_nano.operators.embedding import pad_vocab_size
from kb_nano.operators.lm_head import ParallelLMHead
from kb_nano.operators.norms import QKNorm
from kb_nano.operators.sampler import TopKTopPSampler

# --------------------------------------------------------------------------- gelu_and_mul


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gelu_and_mul_equals_transformers_act(dtype):
    x = randn(5, 2 * 96, dtype=dtype, seed=1, std=2.0)
    act = ACT2FN["gelu_pytorch_tanh"]
    out = GeluAndMul(approximate="tanh")(x)
    torch.testing.assert_close(out, act(x[:, :96]) * x[:, 96:], rtol=0, atol=0)
    # the exact (erf) GELU differs: the approximation is not a no-op
    assert not torch.equal(GeluAndMul()(x.float()), GeluAndMul("tanh")(x.float()))
    with pytest.raises(ValueError, match="approximate"):
        GeluAndMul("fast")


def test_gelu_and_mul_inside_gemma2_mlp():
    cfg = Gemma2Config(hidden_size=64, intermediate_size=96, hidden_activation="gelu_pytorch_tanh")
    mlp = Gemma2MLP(cfg)
    x = randn(3, 64, seed=2)
    with torch.no_grad():
        gate_up = torch.cat((mlp.gate_proj(x), mlp.up_proj(x)), dim=-1)
        want = mlp(x)
        got = mlp.down_proj(GeluAndMul("tanh")(gate_up))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_gelu_and_mul_rules_gemma2(facts_of):
    facts = facts_of("gemma2-2b", hf_config=True)
    op = operators.get("gelu_and_mul")
    assert op.applies_to(facts) and not operators.get("silu_and_mul").applies_to(facts)
    assert op.init_args(facts, 4) == {"approximate": "tanh"}
    _, s = shapes("gelu_and_mul", facts, 4)
    assert s == {"x": [4, 2 * 9216 // 4]}


# --------------------------------------------------------------------------- qk_norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qk_norm_equals_qwen3_q_norm_k_norm(dtype, facts_of):
    facts = facts_of("qwen3-8b", hf_config=True)
    args, s = shapes("qk_norm", facts, 4, n=6)
    assert args == {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "eps": 1e-6}
    assert s == {"q": [6, 8 * 128], "k": [6, 2 * 128]}
    ours = QKNorm(**args)
    q_ref, k_ref = Qwen3RMSNorm(128, eps=1e-6), Qwen3RMSNorm(128, eps=1e-6)
    with torch.no_grad():
        ours.q_norm.weight.copy_(1 + 0.3 * randn(128, seed=1))
        ours.k_norm.weight.copy_(1 + 0.3 * randn(128, seed=2))
        q_ref.weight.copy_(ours.q_norm.weight)
        k_ref.weight.copy_(ours.k_norm.weight)
    assert set(ours.state_dict()) == {"q_norm.weight", "k_norm.weight"}
    ours, q_ref, k_ref = ours.to(dtype), q_ref.to(dtype), k_ref.to(dtype)
    q, k = randn(6, 8 * 128, dtype=dtype, seed=3, std=3), randn(6, 2 * 128, dtype=dtype, seed=4, std=3)
    with torch.no_grad():
        q_out, k_out = ours(q.clone(), k.clone())
        # Qwen3Attention: self.q_norm(self.q_proj(x).view(*input_shape, -1, head_dim))
        q_want = q_ref(q.view(6, -1, 128)).reshape(6, -1)
        k_want = k_ref(k.view(6, -1, 128)).reshape(6, -1)
    torch.testing.assert_close(q_out, q_want, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_want, rtol=0, atol=0)


def test_qk_norm_applies_to_qwen3_only(facts_of):
    applies = {m: operators.get("qk_norm").applies_to(facts_of(m, hf_config=True)) for m in MODELS}
    assert {m for m, a in applies.items() if a} == {"qwen3-8b", "qwen3-30b-a3b"}
    _, s = shapes("qk_norm", facts_of("qwen3-30b-a3b", hf_config=True), 8)  # 4 kv heads: replicated at tp 8
    assert s == {"q": [4, 4 * 128], "k": [4, 128]}


# --------------------------------------------------------------------------- lm_head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lm_head_equals_transformers_lm_head(dtype):
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    hf = LlamaForCausalLM(cfg).lm_head.to(dtype)
    ours = ParallelLMHead(1000, 64, params_dtype=dtype)
    assert ours.weight.shape == (pad_vocab_size(1000), 64) == (1024, 64) and ours.weight.dtype == dtype
    assert torch.count_nonzero(ours.weight[1000:]) == 0  # padding rows are zero, as vLLM loads them
    with torch.no_grad():
        ours.weight[:1000].copy_(hf.weight)
    x = randn(5, 64, dtype=dtype, seed=1)
    with torch.no_grad():
        logits = ours(x)
        want = hf(x)
    assert logits.shape == (5, 1024) and logits.dtype == dtype
    torch.testing.assert_close(logits[:, :1000], want, rtol=0, atol=0)
    assert torch.count_nonzero(logits[:, 1000:]) == 0


def test_lm_head_tp_shards_concatenate_to_full_logits():
    full = ParallelLMHead(1000, 64)
    x = randn(3, 64, seed=2)
    parts = []
    for rank in range(4):
        part = ParallelLMHead(1000, 64, tp_size=4, tp_rank=rank)
        assert part.weight.shape == (256, 64)
        with torch.no_grad():
            part.weight.copy_(full.weight[rank * 256 : (rank + 1) * 256])
            parts.append(part(x))
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(parts, dim=-1), full(x), rtol=1e-6, atol=1e-6)


def test_lm_head_rules(facts_of):
    args, s = shapes("lm_head", facts_of("qwen3-8b", hf_config=True), 4, n=2)
    assert args == {
        "num_embeddings": 151936,
        "embedding_dim": 4096,
        "params_dtype": "bfloat16",
        "tp_size": 4,
        "tp_rank": 0,
    }
    assert s == {"hidden_states": [2, 4096]}
    with pytest.raises(NotApplicable, match="vocab_size"):
        operators.get("lm_head").init_args(facts_of("mixtral-8x7b", hf_config=True), 3)
    assert all(operators.get("lm_head").applies_to(facts_of(m, hf_config=True)) for m in MODELS)
    nbytes, flops = operators.get("lm_head").traffic(
        args, operators.get("lm_head").inputs(args, {}, 4, 2, "bfloat16"), "bfloat16"
    )
    assert flops == 2 * 2 * 4096 * 151936 // 4


def test_lm_head_bias_is_read_from_the_model_and_measured(tmp_path):
    """Phi-3.5-MoE's lm_head has an output bias (``lm_head_bias``): its module tree says so,
    the scenario's baseline adds a drawn bias (semantics ``bias``; transformers' module
    gives the same logits), and a candidate that leaves the bias out is ``incorrect``."""
    from operator_helpers import measure_cpu
    from transformers import PhimoeConfig

    from kb_nano.models.module_tree import read

    small = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    small.update(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, pad_token_id=None)
    facts = {**small, "dtype": "float32", **read(PhimoeConfig(**small, lm_head_bias=True).to_dict())}
    op = operators.get("lm_head")
    assert facts["lm_head_bias"] and op.semantics(facts) == "bias" and op.init_args(facts, 1)["bias"] is True
    assert not read(PhimoeConfig(**small).to_dict())["lm_head_bias"]
    ours = ParallelLMHead(1000, 64, bias=True)
    assert torch.count_nonzero(ours.bias[:1000]) == 1000 and torch.count_nonzero(ours.bias[1000:]) == 0
    hf = torch.nn.Linear(64, 1000)  # PhimoeForCausalLM.lm_head with lm_head_bias
    with torch.no_grad():
        hf.weight.copy_(ours.weight[:1000])
        hf.bias.copy_(ours.bias[:1000])
        x = randn(3, 64, seed=3)
        torch.testing.assert_close(ours(x)[:, :1000], hf(x), rtol=1e-6, atol=1e-6)
    no_bias = tmp_path / "no_bias.py"
    no_bias.write_text(
        "import torch\n"
        "from kb_nano.operators.lm_head import ParallelLMHead\n"
        "class NoBias(ParallelLMHead):\n"
        "    supported_semantics = ('bias',)\n"
        "    def forward(self, hidden_states):\n"
        "        return torch.mm(hidden_states, self.weight.t())\n"
    )
    args = op.init_args(facts, 1)
    scenario = {
        "scenario_id": "lm_head__phi-small__tp1__n4",
        "target": "lm_head",
        "level": 1,
        "category": "embedding",
        "model": "phi-small",
        "tp": 1,
        "num_tokens": 4,
        "dtype": "float32",
        "init_args": args,
        "inputs": op.inputs(args, facts, 1, 4, "float32"),
        "semantics": "bias",
    }
    row = measure_cpu(scenario, "lm_head/no_bias", no_bias)
    assert row["status"] == "incorrect", (row["status"], row["error"])
    from workflow_helpers import REPO

    row = measure_cpu(scenario, "lm_head/mm_transposed", REPO / "candidates/lm_head/mm_transposed.py")
    assert row["status"] == "passed", (row["status"], row["error"])  # the shipped one adds it


# --------------------------------------------------------------------------- sampler


def _hf_sample(logits, q, k, p):
    out = []
    for i in range(logits.shape[0]):
        row = logits[i : i + 1].clone()
        row = TopKLogitsWarper(top_k=int(k[i]))(None, row)
        row = TopPLogitsWarper(top_p=float(p[i]))(None, row)
        probs = row.softmax(dim=-1, dtype=torch.float32)
        out.append(int((probs / q[i : i + 1]).argmax(dim=-1)))
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampler_equals_transformers_warpers(seed, facts_of):
    facts = facts_of("llama32-1b", hf_config=True)
    op = operators.get("sampler")
    specs = op.inputs(op.init_args(facts, 1), facts, 1, 16, "bfloat16")
    assert [s["name"] for s in specs] == ["logits", "q", "k", "p"]
    assert [s["dtype"] for s in specs] == ["float32", "float32", "int32", "float32"]
    g = torch.Generator().manual_seed(seed)
    logits, q, k, p = (make_tensor(s, g, "cpu") for s in specs)
    assert logits.shape == (16, 128256) and float(q.min()) > 0 and int(k.min()) >= 1 and float(p.min()) >= 0.5
    ids = TopKTopPSampler()(logits.clone(), q.clone(), k.clone(), p.clone())
    assert ids.dtype == torch.int64 and ids.shape == (16,)
    assert torch.equal(ids, _hf_sample(logits, q, k, p))
    # every sample lies inside its row's top-k
    kth = torch.stack([logits[i].topk(int(k[i])).values[-1] for i in range(16)])
    assert bool((logits.gather(1, ids[:, None])[:, 0] >= kth).all())


def test_sampler_with_tied_logits_does_not_depend_on_the_sort_order():
    """Logits rounded to bf16 (as the golden ones are) tie often, also at the top-k and
    top-p cuts: the baseline keeps every token equal to a kept one, so permuting the
    vocabulary permutes its samples and nothing else, and the shipped top-k-first
    candidate gives the same tokens."""
    import importlib.util

    from workflow_helpers import REPO

    spec = importlib.util.spec_from_file_location("topk_first", REPO / "candidates/sampler/topk_first.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base, cand = TopKTopPSampler(), module.TopKFirstSampler()
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(32, 4096, generator=g) * 0.4 + 4).to(torch.bfloat16).float()  # few distinct values
    for _ in range(5):
        q = torch.empty_like(logits).exponential_(generator=g)
        k = torch.randint(1, 65, (32,), generator=g, dtype=torch.int32)
        p = torch.rand(32, generator=g) * 0.5 + 0.5
        perm = torch.randperm(4096, generator=g)
        want = base(logits, q, k, p)
        assert torch.equal(perm[base(logits[:, perm], q[:, perm], k, p)], want)
        assert torch.equal(cand(logits, q, k, p), want)


def test_sampler_top_k_one_is_greedy_and_q_changes_samples():
    logits = randn(4, 500, seed=3, std=3)
    q = torch.empty(4, 500).exponential_(generator=torch.Generator().manual_seed(0))
    ones = torch.ones(4, dtype=torch.int32)
    assert torch.equal(TopKTopPSampler()(logits, q, ones, torch.full((4,), 0.9)), logits.argmax(-1))
    full = torch.full((4,), 500, dtype=torch.int32)
    a = TopKTopPSampler()(logits, q, full, torch.ones(4))
    b = TopKTopPSampler()(logits, q.flip(-1), full, torch.ones(4))
    assert not torch.equal(a, b)


def test_sampler_same_at_every_tp(facts_of):
    facts = facts_of("qwen3-8b", hf_config=True)
    assert shapes("sampler", facts, 1) == shapes("sampler", facts, 8)
