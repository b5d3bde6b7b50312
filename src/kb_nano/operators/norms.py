"""Norm baselines: ``rms_norm``, ``fused_add_rms_norm`` (vLLM ``RMSNorm``), ``qk_norm``
(the per-head RMSNorm of q and k in Qwen3 / Qwen3-MoE / Gemma-3 attention, weightless in
Llama-4's: semantics ``no_weight``) and ``layer_norm`` (the
``torch.nn.LayerNorm`` of models that normalise with mean and bias, Phi-3.5-MoE; vLLM builds
the same module).

Semantics follow vLLM ``RMSNorm.forward_native`` and the transformers ``LlamaRMSNorm``:
compute in float32, ``x * rsqrt(mean(x^2) + eps)``, cast back to the input dtype, then
multiply by ``weight`` in that dtype. With ``residual`` the sum ``x + residual`` is
normalised and also returned as the new residual (in the input dtype).

Gemma's norms (transformers ``GemmaRMSNorm``/``Gemma2RMSNorm``/``Gemma3RMSNorm``, vLLM
``GemmaRMSNorm``) scale by ``1 + weight`` instead, in float32 before the cast back
(``(x * (1 + w)).to(dtype)`` where Llama does ``x.to(dtype) * w``). Which form a model
uses is read from its own norm module (:func:`kb_nano.models.norm_tree.hidden_norm`),
not from its name: those scenarios have the ``gemma`` semantics (id suffix ``__gemma``),
which a candidate declares in ``supported_semantics``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kb_nano.operators.base import (
    NotApplicable,
    Operator,
    element_size,
    kv_heads_per_rank,
    normal,
    shard,
)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with vLLM's signature.

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: ``rms_norm_eps`` of the model config.
        weight_offset: 0 (Llama: ``x.to(dtype) * w``) or 1 (Gemma: ``(x * (1 + w)).to(dtype)``,
            and the residual sum rounded to the input dtype before it is normalised: vLLM
            ``GemmaRMSNorm.forward_static``); passed only for Gemma-form models.
        has_weight: False for a norm without a weight (vLLM ``RMSNorm(..., has_weight=False)``,
            Llama-4's q/k norm: ``x * rsqrt(mean(x^2) + eps)`` cast back); passed only then.
    Forward:
        x: ``[num_tokens, hidden_size]``, bf16/fp16/fp32.
        residual: optional ``[num_tokens, hidden_size]`` same dtype.
    Returns:
        ``[num_tokens, hidden_size]`` in x's dtype, or ``(out, new_residual)`` with residual.
    State dict: ``weight`` ``[hidden_size]`` (initialised to ones as in vLLM); empty
    without a weight.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0, has_weight: bool = True
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight_offset = float(weight_offset)
        self.weight = nn.Parameter(torch.ones(hidden_size)) if has_weight else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        if residual is not None:
            x = x + residual.to(torch.float32)
            residual = x.to(orig_dtype)
            if self.weight_offset:  # Gemma normalises the sum in the input dtype (vLLM GemmaRMSNorm)
                x = residual.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight is None:
            x = x.to(orig_dtype)
        elif self.weight_offset:
            x = (x * (self.weight_offset + self.weight.float())).to(orig_dtype)
        else:
            x = x.to(orig_dtype) * self.weight
        return x if residual is None else (x, residual)


class LayerNorm(nn.Module):
    """``torch.nn.LayerNorm`` over the last dimension with the model's ``eps`` (transformers
    and vLLM ``PhiMoEDecoderLayer``: ``nn.LayerNorm(hidden_size, eps=rms_norm_eps)``):
    ``(x - mean) / sqrt(var + eps) * weight + bias`` (biased variance), computed by
    ``F.layer_norm`` (float32 inside for bf16/fp16 inputs, rounded once).

    Args: hidden_size, eps, bias (whether the module has a bias).
    Forward: x ``[num_tokens, hidden_size]``. Returns ``[num_tokens, hidden_size]`` in x's dtype.
    State dict: ``weight`` ``[hidden_size]`` (ones), ``bias`` ``[hidden_size]`` (zeros) when
    built with ``bias=True``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


def _uses_rms_norm(facts: dict) -> bool:
    """False for a model whose hidden norms are LayerNorms (module tree: ``layer_norm`` set,
    no RMSNorm), which ``layer_norm`` measures; True otherwise (a model with neither is
    ``not covered`` by :func:`norm_weight_offset`)."""
    return not (facts.get("layer_norm") and (facts.get("hidden_norm") or {}).get("class") is None)


def _uses_fused_add(facts: dict) -> bool:
    """:func:`_uses_rms_norm`, and the residual is added before a norm (not after it, as
    in the post-norm layers of Olmo-2: :func:`kb_nano.models.norm_tree.residual_add`)."""
    return _uses_rms_norm(facts) and (facts.get("residual_add") or {}).get("form") != "post_norm"


def _fused_init_args(facts: dict, tp: int) -> dict:
    """:func:`_init_args`; raises ``NotApplicable`` (``not covered``) where the layer
    scales the sublayer's output before the add (Granite's ``residual_multiplier``)."""
    add = facts.get("residual_add") or {}
    if add.get("form") == "scaled":
        raise NotApplicable(add["reason"])
    return _init_args(facts, tp)


def _layer_init_args(facts: dict, tp: int) -> dict:
    ln = facts["layer_norm"]
    if ln.get("reason"):
        raise NotApplicable(ln["reason"])
    return {"hidden_size": facts["hidden_size"], "eps": ln["eps"], "bias": ln["bias"]}


# std of the per-row offsets of layer_norm's inputs: rows of N(0, 1) values have means of
# about 1/sqrt(hidden_size), which an RMSNorm in place of the LayerNorm (no mean removed)
# would get away with; offsets of N(0, 2^2) make the mean of most rows larger than the spread
LAYER_NORM_ROW_MEAN_STD = 2.0


def _layer_inputs(args, facts, tp, num_tokens, dtype):
    return [normal("x", [num_tokens, args["hidden_size"]], dtype, row_mean_std=LAYER_NORM_ROW_MEAN_STD)]


def _layer_traffic(args, inputs, dtype):
    (x,) = inputs
    n, h = x["shape"]
    es = element_size(x["dtype"])
    # read x, write out, weight and bias once; mean, centre, square-sum, scale, affine ~ 7 per element
    return 2 * n * h * es + 2 * h * es, 7 * n * h


def norm_weight_offset(facts: dict, which: str = "hidden_norm") -> float:
    """The form of the model's RMSNorm ``which`` (``hidden_norm`` or ``qk_norm``, read from
    its module tree by :func:`kb_nano.models.module_tree.read`): 0.0 (Llama) or 1.0
    (Gemma); 0.0 for facts without it (a config read without the tree: unit tests).
    Raises ``NotApplicable`` with the ``not covered: ...`` reason when the tree's norm is
    neither."""
    norm = facts.get(which)
    if norm is None:
        return 0.0
    if norm["weight_offset"] is None:
        raise NotApplicable(norm["reason"])
    return float(norm["weight_offset"])


def norm_eps(facts: dict, which: str = "hidden_norm") -> float:
    """The epsilon of the model's RMSNorm ``which``: its module's (module tree), else the
    config's ``rms_norm_eps``. Raises ``NotApplicable`` (``not covered``) with neither."""
    eps = (facts.get(which) or {}).get("eps")
    eps = facts.get("rms_norm_eps") if eps is None else eps
    if eps is None:
        raise NotApplicable("not covered: no epsilon on the model's norm module and no rms_norm_eps in its config")
    return float(eps)


def norm_semantics(facts: dict, which: str = "hidden_norm") -> str:
    """``gemma`` for a model whose norm ``which`` scales by ``1 + weight``, ``no_weight``
    for one without a weight (Llama-4's q/k norm), else ``""``."""
    norm = facts.get(which) or {}
    if norm.get("has_weight") is False:
        return "no_weight"
    return "gemma" if norm.get("weight_offset") == 1.0 else ""


def _init_args(facts: dict, tp: int) -> dict:
    # The hidden dimension is replicated across TP ranks: same shape at every TP.
    offset = norm_weight_offset(facts)
    return {
        "hidden_size": facts["hidden_size"],
        "eps": norm_eps(facts),
        **({"weight_offset": offset} if offset else {}),
    }


def _rms_inputs(args, facts, tp, num_tokens, dtype):
    return [normal("x", [num_tokens, args["hidden_size"]], dtype)]


def _fused_inputs(args, facts, tp, num_tokens, dtype):
    h = args["hidden_size"]
    return [normal("x", [num_tokens, h], dtype), normal("residual", [num_tokens, h], dtype)]


def _rms_traffic(args, inputs, dtype):
    (x,) = inputs
    n, h = x["shape"]
    es = element_size(x["dtype"])
    return 2 * n * h * es + h * es, 4 * n * h


def _fused_traffic(args, inputs, dtype):
    n, h = inputs[0]["shape"]
    es = element_size(inputs[0]["dtype"])
    return 4 * n * h * es + h * es, 5 * n * h


# Without the module tree (facts of a config alone): architectures whose attention normalises
# q and k per head before RoPE (transformers
# ``Qwen3Attention`` / ``Qwen3MoeAttention``: ``q_norm``/``k_norm`` = RMSNorm(head_dim); vLLM
# ``Qwen3Attention`` / ``Qwen3MoeAttention``). Llama, Mistral, Mixtral, Qwen2 have none.
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")


class QKNorm(nn.Module):
    """RMSNorm over ``head_dim`` applied to every head of q and of k (Qwen3 QK-norm;
    Llama-4's weightless L2 norm, after RoPE on its layers with rotation: vLLM
    ``Llama4Attention``'s ``RMSNorm(head_dim, has_weight=False)`` on q and on k).

    vLLM ``Qwen3Attention.forward`` views q ``[N, heads * head_dim]`` as
    ``[N, heads, head_dim]``, applies ``self.q_norm`` (``RMSNorm(head_dim, eps)``) and views
    it back; the same for k with ``self.k_norm``. Here both norms are one module (a fusion
    target: vLLM's ``fused_qk_norm_rope`` does this together with RoPE).

    Args:
        num_heads: query heads on this rank (``num_attention_heads / tp``).
        num_kv_heads: key heads on this rank (divided, or replicated when tp > kv heads).
        head_dim: normalised size.
        eps: ``rms_norm_eps``.
        weight_offset: 1 for Gemma-form norms (``x / rms(x) * (1 + w)``: Gemma-3), as
            :class:`RMSNorm`; passed only for those.
        has_weight: False for Llama-4's weightless norm (as :class:`RMSNorm`); passed only then.
    Forward: q ``[num_tokens, num_heads * head_dim]``, k ``[num_tokens, num_kv_heads * head_dim]``.
    Returns ``(q, k)`` normalised, same shapes and dtype.
    State dict: ``q_norm.weight``, ``k_norm.weight`` ``[head_dim]`` (vLLM's parameter names);
    empty without a weight.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float = 1e-6,
        weight_offset: float = 0.0,
        has_weight: bool = True,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_norm = RMSNorm(head_dim, eps, weight_offset, has_weight)
        self.k_norm = RMSNorm(head_dim, eps, weight_offset, has_weight)

    def forward(self, q: torch.Tensor, k: torch.Tensor):
        q_by_head = self.q_norm(q.view(*q.shape[:-1], q.shape[-1] // self.head_dim, self.head_dim))
        k_by_head = self.k_norm(k.view(*k.shape[:-1], k.shape[-1] // self.head_dim, self.head_dim))
        return q_by_head.view(q.shape), k_by_head.view(k.shape)


def _qk_init_args(facts: dict, tp: int) -> dict:
    offset = norm_weight_offset(facts, "qk_norm")
    weightless = (facts.get("qk_norm") or {}).get("has_weight") is False
    return {
        "num_heads": shard(facts["num_attention_heads"], tp, "num_attention_heads"),
        "num_kv_heads": kv_heads_per_rank(facts["num_key_value_heads"], tp),
        "head_dim": facts["head_dim"],
        "eps": norm_eps(facts, "qk_norm"),
        **({"weight_offset": offset} if offset else {}),
        **({"has_weight": False} if weightless else {}),
    }


def _uses_qk_norm(facts: dict) -> bool:
    """Whether the model's attention normalises q and k per head: read from its module tree
    (``facts['qk_norm']``) when the facts have it, else by model type."""
    if "qk_norm" in facts:
        return facts["qk_norm"] is not None
    return facts["model_type"] in QK_NORM_MODEL_TYPES


def _qk_inputs(args, facts, tp, num_tokens, dtype):
    d = args["head_dim"]
    return [
        normal("q", [num_tokens, args["num_heads"] * d], dtype),
        normal("k", [num_tokens, args["num_kv_heads"] * d], dtype),
    ]


def _qk_traffic(args, inputs, dtype):
    q, k = inputs
    n = q["shape"][0]
    es = element_size(q["dtype"])
    width = q["shape"][1] + k["shape"][1]
    # As rms_norm per head: read + write q and k, two weights (none without); 4 flops per element.
    weights = 2 * args["head_dim"] * es if args.get("has_weight", True) else 0
    return 2 * n * width * es + weights, 4 * n * width


# an all-zero row (0 / sqrt(0 + eps)) and variance near eps; not "large": the output does not
# depend on the scale, but two correct bf16 kernels then differ by 2 ulps on rare elements
# (seen on the H200: rms_norm/triton_rowwise, 1 of 262144 elements, 0.0625 at |y| ~ 5)
NORM_EDGE_CASES = ("zero_row", "tiny")

OPERATORS = {
    "qk_norm": Operator(
        name="qk_norm",
        level=1,
        category="norm",
        baseline=QKNorm,
        init_args=_qk_init_args,
        inputs=_qk_inputs,
        traffic=_qk_traffic,
        used_in="layers.*.self_attn.q_norm / k_norm (per head, after qkv_proj, before rotary_emb: Qwen3, Gemma-3); "
        "Llama-4: self_attn.qk_norm (weightless, after rotary_emb, on the layers with rotation)",
        applies_to=_uses_qk_norm,
        edge_cases=NORM_EDGE_CASES,
        semantics=lambda facts: norm_semantics(facts, "qk_norm"),
        reads_module_tree=True,
    ),
    "rms_norm": Operator(
        name="rms_norm",
        level=1,
        category="norm",
        baseline=RMSNorm,
        init_args=_init_args,
        inputs=_rms_inputs,
        traffic=_rms_traffic,
        used_in="model.norm (final norm); input_layernorm of layer 0",
        applies_to=_uses_rms_norm,
        edge_cases=NORM_EDGE_CASES,
        semantics=norm_semantics,
        reads_module_tree=True,
    ),
    "fused_add_rms_norm": Operator(
        name="fused_add_rms_norm",
        level=1,
        category="norm",
        baseline=RMSNorm,
        init_args=_fused_init_args,
        inputs=_fused_inputs,
        traffic=_fused_traffic,
        used_in="layers.*.input_layernorm (layers >= 1), layers.*.post_attention_layernorm",
        mutable_inputs=("x", "residual"),  # vLLM's fused_add_rms_norm writes both in place
        applies_to=_uses_fused_add,
        edge_cases=NORM_EDGE_CASES,
        semantics=norm_semantics,
        reads_module_tree=True,
    ),
    "layer_norm": Operator(
        name="layer_norm",
        level=1,
        category="norm",
        baseline=LayerNorm,
        init_args=_layer_init_args,
        inputs=_layer_inputs,
        traffic=_layer_traffic,
        used_in="layers.*.input_layernorm, layers.*.post_attention_layernorm, model.norm (LayerNorm models: Phi-3.5-MoE)",
        applies_to=lambda facts: bool(facts.get("layer_norm")),
        edge_cases=NORM_EDGE_CASES,
        reads_module_tree=True,
    ),
}
