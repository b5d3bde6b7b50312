"""Gated activations of the MLP: ``silu_and_mul`` (vLLM ``SiluAndMul``, SwiGLU: Llama, Qwen,
Mistral), ``gelu_and_mul`` (vLLM ``GeluAndMul``, GeGLU: ``approximate="tanh"`` for Gemma's
``gelu_pytorch_tanh``, ``"none"`` for an exact ``gelu``) and
``swigluoai_and_mul`` (vLLM ``SwigluOAIAndMul``, gpt-oss's clamped SwiGLU between its
experts' two GEMMs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kb_nano.operators.base import (
    NotApplicable,
    Operator,
    config_field,
    dense_mlp,
    element_size,
    intermediate_size,
    moe_not_covered,
    normal,
    shard,
)
from kb_nano.operators.moe_parts import swiglu_oai


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2`` (vLLM ``forward_native``;
    transformers ``LlamaMLP``: ``act_fn(gate_proj(x)) * up_proj(x)``).

    Forward: x ``[num_tokens, 2 * d]`` (gate and up halves, TP-sharded ``d =
    intermediate_size / tp``). Returns ``[num_tokens, d]`` in x's dtype. No parameters.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def _experts(facts: dict) -> dict:
    """The module tree's facts of the MoE block's experts (``act``, ``bias``, gpt-oss's
    ``swiglu_alpha``/``swiglu_limit``: :func:`kb_nano.models.ffn_tree.experts_facts`), ``{}``
    for a model without an MoE block or facts without the tree."""
    moe = (facts.get("mlp_blocks") or {}).get("moe") or {}
    return moe.get("experts") or ({"act": None} if moe else {})


def _rows_width(facts: dict, num_tokens: int = 1) -> tuple[int, int]:
    """Rows and width ``intermediate_size`` of the gated activation for ``num_tokens``
    tokens: the model's own dense MLP's width (module tree,
    :func:`kb_nano.operators.base.dense_mlp`) where it has one; in a model whose every
    layer is an MoE block the harness covers, the experts' activation inside vLLM's
    ``fused_experts`` (``num_tokens * top_k`` rows of one expert's width,
    ``moe_intermediate_size``); else the config's ``intermediate_size``. Raises
    ``NotApplicable`` (``not covered``) for a model whose only feed-forward blocks are MoE
    blocks the harness does not cover, or whose experts' activation is none that
    :func:`kb_nano.models.ffn_tree.experts_facts` recognises (SiLU-and-mul; gpt-oss's
    clamped SwiGLU, ``swigluoai``, measured by ``swigluoai_and_mul``)."""
    from kb_nano.operators.moe import moe_intermediate_size

    dense = dense_mlp(facts)
    if dense is None and moe_not_covered(facts):
        raise NotApplicable(moe_not_covered(facts))
    moe = (facts.get("mlp_blocks") or {}).get("moe") or {}
    if dense is None and moe and _experts(facts).get("act") not in ("silu", "swigluoai"):
        raise NotApplicable(
            f"not covered: {moe['class']}'s experts compute an activation kb-nano does not recognise "
            "(measured inside fused_moe only)"
        )
    if dense is not None and dense["intermediate_size"]:
        return num_tokens, int(dense["intermediate_size"])
    if dense is None and (facts.get("mlp_blocks") or {}).get("moe"):
        top_k = int(config_field(facts, "num_experts_per_tok", default=1))
        return num_tokens * top_k, moe_intermediate_size(facts)
    return num_tokens, intermediate_size(facts)


def _init_args(facts: dict, tp: int) -> dict:
    shard(_rows_width(facts)[1], tp, "intermediate_size")
    return {}


def _inputs(args, facts, tp, num_tokens, dtype):
    rows, width = _rows_width(facts, num_tokens)
    return [normal("x", [rows, 2 * shard(width, tp, "intermediate_size")], dtype)]


def _uses(act: str, hidden_acts: tuple[str, ...]):
    """``applies_to`` of a gated activation: the model's dense MLP has activation ``act``
    (module tree), else (MoE in every layer, or no tree) the config's ``hidden_act`` is
    one of ``hidden_acts``."""

    def applies(facts: dict) -> bool:
        dense = dense_mlp(facts)
        if dense is not None:  # an MLP without a gate (down(act(up(x)))) has no *_and_mul
            return dense["act"] == act and dense.get("gated", True)
        experts = _experts(facts)
        if experts:  # an unknown experts' activation (None) is ``not covered``, said by _rows_width
            return experts.get("act", "silu") in (act, None)
        return facts["hidden_act"] in hidden_acts

    return applies


def _traffic(args, inputs, dtype):
    n, two_d = inputs[0]["shape"]
    es = element_size(inputs[0]["dtype"])
    d = two_d // 2
    # read gate and up, write out; silu ~ 4 flops (exp, add, div, mul) + 1 mul.
    return 3 * n * d * es, 5 * n * d


# hidden_act values whose function is GELU with the tanh approximation
# (transformers ``ACT2FN``: ``gelu_pytorch_tanh`` = ``F.gelu(x, approximate="tanh")``).
GELU_TANH_ACTS = ("gelu_pytorch_tanh",)
# hidden_act values whose function is the exact (erf) GELU: ``F.gelu(x)`` (vLLM
# ``GeluAndMul(approximate="none")``)
GELU_EXACT_ACTS = ("gelu",)


class GeluAndMul(nn.Module):
    """``gelu(x[..., :d], approximate) * x[..., d:]`` with ``d = x.shape[-1] // 2`` (vLLM
    ``GeluAndMul.forward_native``; transformers ``GemmaMLP``/``Gemma2MLP``:
    ``act_fn(gate_proj(x)) * up_proj(x)`` with ``act_fn = gelu_pytorch_tanh``).

    Args: approximate: ``"none"`` (exact erf GELU) or ``"tanh"`` (Gemma's
    ``gelu_pytorch_tanh``), as in vLLM.
    Forward: x ``[num_tokens, 2 * d]`` (gate and up halves, ``d = intermediate_size / tp``).
    Returns ``[num_tokens, d]`` in x's dtype. No parameters.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"unknown approximate value {approximate!r}; expected 'none' or 'tanh'")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


def _gelu_init_args(facts: dict, tp: int) -> dict:
    shard(intermediate_size(facts), tp, "intermediate_size")
    return {"approximate": _gelu_approximate(facts)}


def _gelu_approximate(facts: dict) -> str:
    """``"none"`` for the exact GELU (the module tree's MLP activation ``gelu``: transformers
    ``GELUActivation`` of ``hidden_act`` ``gelu``; without a tree, that ``hidden_act``),
    ``"tanh"`` otherwise (Gemma's ``gelu_pytorch_tanh``, GPT-2's ``gelu_new``)."""
    dense = dense_mlp(facts)
    act = dense["act"] if dense is not None else facts.get("hidden_act")
    return "none" if act in ("gelu", *GELU_EXACT_ACTS) else "tanh"


def _uses_gelu(facts: dict) -> bool:
    """``applies_to`` of ``gelu_and_mul``: a gated MLP whose activation is GELU of either
    form (:func:`_uses`)."""
    return any(_uses(act, acts)(facts) for act, acts in (("gelu_tanh", GELU_TANH_ACTS), ("gelu", GELU_EXACT_ACTS)))


def _gelu_traffic(args, inputs, dtype):
    n, two_d = inputs[0]["shape"]
    es = element_size(inputs[0]["dtype"])
    d = two_d // 2
    # read gate and up, write out. tanh-GELU 0.5*x*(1+tanh(c*(x+0.044715*x^3))):
    # ~8 flops + tanh (counted as 1) + the gating mul = 10 per output element.
    return 3 * n * d * es, 10 * n * d


class SwigluOAIAndMul(nn.Module):
    """gpt-oss's clamped SwiGLU: gate ``x[..., 0::2]`` clamped to at most ``limit``, up
    ``x[..., 1::2]`` clamped to ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha *
    gate)`` (vLLM ``SwigluOAIAndMul.forward_native``, the activation of ``fused_experts``
    with ``activation="swigluoai"``; transformers ``GptOssExperts._apply_gate``:
    :func:`kb_nano.operators.moe_parts.swiglu_oai`). Gate and up columns alternate.

    Args: alpha (``GptOssExperts.alpha``, 1.702), limit (``config.swiglu_limit``, 7.0).
    Forward: x ``[num_tokens * top_k, 2 * d]`` (``d = intermediate_size / tp``, one expert's
    width). Returns ``[num_tokens * top_k, d]`` in x's dtype. No parameters.
    """

    def __init__(self, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.alpha, self.limit = float(alpha), float(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_oai(x, self.alpha, self.limit)


# std of swigluoai_and_mul's inputs: N(0, 4^2) puts about 8% of the values past the clamp at
# +-7 and most of the gate where the sigmoid bends, so a candidate without the clamp or with
# another alpha fails (with N(0, 1) both would pass: |x| > 7 almost never happens)
SWIGLUOAI_INPUT_STD = 4.0


def _swigluoai_applies(facts: dict) -> bool:
    return _experts(facts).get("act") == "swigluoai"


def _swigluoai_init_args(facts: dict, tp: int) -> dict:
    shard(_rows_width(facts)[1], tp, "intermediate_size")
    experts = _experts(facts)
    return {"alpha": experts["swiglu_alpha"], "limit": experts["swiglu_limit"]}


def _swigluoai_inputs(args, facts, tp, num_tokens, dtype):
    rows, width = _rows_width(facts, num_tokens)
    return [normal("x", [rows, 2 * shard(width, tp, "intermediate_size")], dtype, std=SWIGLUOAI_INPUT_STD)]


def _swigluoai_traffic(args, inputs, dtype):
    n, two_d = inputs[0]["shape"]
    es = element_size(inputs[0]["dtype"])
    d = two_d // 2
    # read gate and up, write out; 3 clamps, alpha * gate, sigmoid (~4: neg, exp, add, div),
    # gate * sigmoid, up + 1, the final mul = 10 per output element.
    return 3 * n * d * es, 10 * n * d


OPERATORS = {
    "gelu_and_mul": Operator(
        name="gelu_and_mul",
        level=1,
        category="activation",
        baseline=GeluAndMul,
        init_args=_gelu_init_args,
        inputs=_inputs,
        traffic=_gelu_traffic,
        used_in="layers.*.mlp.act_fn (GeGLU, between gate_up_proj and down_proj; tanh or exact GELU)",
        applies_to=_uses_gelu,
        reads_module_tree=True,
        edge_cases=("tiny", "large"),
    ),
    "silu_and_mul": Operator(
        name="silu_and_mul",
        level=1,
        category="activation",
        baseline=SiluAndMul,
        init_args=_init_args,
        inputs=_inputs,
        traffic=_traffic,
        used_in=(
            "layers.*.mlp.act_fn (between gate_up_proj and down_proj); in a model of MoE layers, between "
            "the experts' two GEMMs (num_tokens * top_k rows, vLLM fused_experts)"
        ),
        applies_to=_uses("silu", ("silu",)),
        reads_module_tree=True,
        edge_cases=("tiny", "large"),
    ),
    "swigluoai_and_mul": Operator(
        name="swigluoai_and_mul",
        level=1,
        category="activation",
        baseline=SwigluOAIAndMul,
        init_args=_swigluoai_init_args,
        inputs=_swigluoai_inputs,
        traffic=_swigluoai_traffic,
        used_in=(
            "layers.*.mlp.experts (gpt-oss: between the experts' two GEMMs, num_tokens * top_k rows of "
            "interleaved gate/up columns, vLLM fused_experts activation='swigluoai')"
        ),
        applies_to=_swigluoai_applies,
        reads_module_tree=True,
        edge_cases=("tiny", "large"),
    ),
}
