"""The ``fused_moe`` constructor arguments of each MoE semantics beyond the standard form
(:mod:`kb_nano.operators.moe`): what the model's own MoE block computes, read from its
module tree (``facts['mlp_blocks']``, :mod:`kb_nano.models.ffn_tree`) and its config.
Each function takes ``(facts, tp)`` and returns the extra ``init_args``, or raises
``NotApplicable`` (``not covered: ...``) for a block of that class the baseline does not
compute."""

from __future__ import annotations

from kb_nano.operators.base import NotApplicable, config_field, shard


def moe_semantics(facts: dict) -> str:
    """The semantics of the model's MoE block from its module tree (``deepseek_v3`` for
    ``DeepseekV3MoE``, ``gpt_oss`` for ``GptOssMLP``, ``llama4`` for ``Llama4TextMoe``, ``phimoe``
    for ``PhimoeSparseMoeBlock``: :data:`kb_nano.models.ffn_tree.COVERED_MOE`), ``""`` otherwise."""
    return (((facts.get("mlp_blocks") or {}).get("moe")) or {}).get("semantics") or ""


def shared_width(facts: dict, tp: int) -> int:
    """The full width of the MoE block's shared experts (the module tree's ``shared_experts``
    entry); raises ``NotApplicable`` when they are missing or not SiLU-gated, or TP does not
    divide their width."""
    shared = next((d for d in facts["mlp_blocks"]["dense"] if d["where"] == "shared_experts"), None)
    cls = facts["mlp_blocks"]["moe"]["class"]
    if shared is None or shared["act"] != "silu" or not shared["intermediate_size"]:
        raise NotApplicable(f"not covered: {cls} without SiLU-gated shared experts")
    shard(shared["intermediate_size"], tp, "shared experts' intermediate_size")
    return int(shared["intermediate_size"])


def deepseek_v3_args(facts: dict, tp: int) -> dict:
    """The grouped sigmoid routing, bias, scaling and shared experts of a DeepSeek-V3 block."""
    scoring, method = config_field(facts, "scoring_func"), config_field(facts, "topk_method")
    if scoring != "sigmoid" or method != "noaux_tc":
        raise NotApplicable(
            f"not covered: DeepseekV3MoE with scoring_func={scoring!r}, topk_method={method!r} (transformers "
            "always scores with sigmoid and a correction bias; vLLM follows the config: they differ)"
        )
    return {
        "use_grouped_topk": True,
        "num_expert_group": int(config_field(facts, "n_group")),
        "topk_group": int(config_field(facts, "topk_group")),
        "scoring_func": "sigmoid",
        "routed_scaling_factor": float(config_field(facts, "routed_scaling_factor", default=1.0)),
        "e_score_correction_bias": True,
        "shared_experts_intermediate_size": shared_width(facts, tp),
    }


def gpt_oss_args(facts: dict, tp: int) -> dict:
    """The biased experts and clamped SwiGLU of a gpt-oss block, from its experts module
    (:func:`kb_nano.models.ffn_tree.experts_facts`)."""
    experts = facts["mlp_blocks"]["moe"]["experts"]
    return {
        "has_bias": bool(experts["bias"]),
        "activation": "swigluoai",
        "swiglu_alpha": experts["swiglu_alpha"],
        "swiglu_limit": experts["swiglu_limit"],
    }


def llama4_args(facts: dict, tp: int) -> dict:
    """Llama-4's routing (the sigmoid of the top-1 logit, not renormalised, scaling the
    expert's input) and its shared expert."""
    top_k = int(config_field(facts, "num_experts_per_tok"))
    if top_k != 1:
        raise NotApplicable(f"not covered: Llama4TextMoe with num_experts_per_tok={top_k} (vLLM runs top-1 only)")
    return {
        "scoring_func": "sigmoid",
        "renormalize": False,
        "apply_router_weight_on_input": True,
        "shared_experts_intermediate_size": shared_width(facts, tp),
    }


# the jitter_eps vLLM's phimoe_routing_function always routes with (it does not read the config)
VLLM_PHIMOE_JITTER_EPS = 0.01


def phimoe_args(facts: dict, tp: int) -> dict:
    """Phi-3.5-MoE's sparsemixer top-2 routing (eval mode, not renormalised) with the config's
    ``router_jitter_noise`` as ``jitter_eps``. Raises ``NotApplicable`` for top-k other than 2
    (sparsemixer always routes to 2 experts; vLLM asserts it) or a ``router_jitter_noise``
    other than the 0.01 vLLM's routing function uses whatever the config says."""
    top_k = int(config_field(facts, "num_experts_per_tok"))
    if top_k != 2:
        raise NotApplicable(
            f"not covered: PhimoeSparseMoeBlock with num_experts_per_tok={top_k} (sparsemixer is top-2)"
        )
    eps = float(config_field(facts, "router_jitter_noise", default=VLLM_PHIMOE_JITTER_EPS))
    if eps != VLLM_PHIMOE_JITTER_EPS:
        raise NotApplicable(
            f"not covered: PhimoeSparseMoeBlock with router_jitter_noise={eps} (transformers routes with it, "
            f"vLLM's phimoe_routing_function with {VLLM_PHIMOE_JITTER_EPS}: they differ)"
        )
    return {"renormalize": False, "custom_routing_function": "sparsemixer", "jitter_eps": eps}


# semantics -> its extra init_args
SEMANTICS_ARGS = {
    "deepseek_v3": deepseek_v3_args,
    "gpt_oss": gpt_oss_args,
    "llama4": llama4_args,
    "phimoe": phimoe_args,
}
