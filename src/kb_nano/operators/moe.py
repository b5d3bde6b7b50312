"""L2 ``fused_moe`` baseline (vLLM ``FusedMoE``), per TP rank: Mixtral, Qwen3-MoE, DeepSeek-V3,
gpt-oss, Llama-4, Phi-3.5-MoE.

``forward(hidden_states, router_logits)``: softmax of the router logits in fp32, top-k
experts per token, renormalised to sum 1 when ``renormalize`` (vLLM ``fused_topk``;
Mixtral always, Qwen3-MoE when ``norm_topk_prob``), then for every expert hit:
``w2 @ silu_and_mul(w13 @ x)`` of its tokens, times the routing weight, added into the
output. The router GEMM (vLLM ``ReplicatedLinear`` ``gate``) stays outside, as in vLLM.
The loop, the fp32 routing weights and the accumulation into an output of the model
dtype in expert order are those of transformers ``MixtralExperts`` /
``Qwen3MoeExperts``, so the baseline equals ``MixtralSparseMoeBlock`` bit for bit and
``Qwen3MoeSparseMoeBlock`` up to Qwen's rounding of the routing weights to the model
dtype first.

DeepSeek-V3 (``DeepseekV3MoE``; scenarios with the ``deepseek_v3`` semantics, id suffix
``__deepseek_v3``), as vLLM's ``DeepseekV2MoE`` runs it (``FusedMoE`` with
``use_grouped_topk``, ``scoring_func="sigmoid"``, the gate's ``e_score_correction_bias``,
its ``shared_experts`` and ``routed_scaling_factor``):

- routing: vLLM ``grouped_topk`` (:func:`kb_nano.operators.moe_parts.grouped_topk`; its
  CUDA form is the ``ops.grouped_topk`` kernel): sigmoid scores in fp32; the bias
  (``e_score_correction_bias`` ``[E]``, a parameter here) added for the choice only: each of
  the ``n_group`` groups scored by its two best biased scores, the ``topk_group`` best groups
  kept, the top-k experts of those on biased scores; weights = the chosen experts' unbiased
  scores, renormalised when ``norm_topk_prob``.
- ``routed_scaling_factor`` multiplies the routed experts' summed output in the model dtype,
  before the shared experts' output is added: where vLLM's ``MoERunner``
  (``_maybe_apply_routed_scale_to_output``) applies it, as ``DeepseekV2DecoderLayer`` asks
  with ``apply_routed_scale_to_output`` (on ROCm AITER ``grouped_topk`` multiplies the
  weights instead; transformers' ``DeepseekV3TopkRouter`` too; in fp16 vLLM divides the
  shared output instead and its decoder layer rescales: the baseline computes the block's
  true output in every dtype).
- shared experts: a tensor-parallel gated MLP (vLLM ``DeepseekV2MLP``, ``reduce_results=False``:
  :class:`kb_nano.operators.moe_parts.SharedExperts`) of width ``moe_intermediate_size *
  n_shared_experts``, its partial sum added to the routed experts' (vLLM ``SharedFusedMoE``
  adds them before the one all-reduce).

gpt-oss (``GptOssMLP``; semantics ``gpt_oss``), as vLLM's ``GptOssModel`` ``MLPBlock`` runs
it (``FusedMoE`` with ``has_bias=True``, ``activation="swigluoai"``, ``renormalize=True``):

- routing: the router (a linear layer with a bias, outside like every router GEMM) gives the
  logits; ``fused_topk`` with renormalisation, which equals transformers' softmax over the
  top-k logits (``GptOssTopKRouter``; vLLM keeps the weights in fp32, transformers rounds
  them to the model dtype).
- experts: ``w13_weight`` ``[E, 2 * I/tp, hidden]`` with gate and up rows interleaved (row
  ``2j`` gate, ``2j + 1`` up: transformers' ``gate_up_proj`` ``[E, hidden, 2I]`` transposed,
  as vLLM loads it) plus ``w13_bias`` ``[E, 2 * I/tp]``; the clamped SwiGLU
  (:func:`kb_nano.operators.moe_parts.swiglu_oai`, alpha and limit from the module:
  1.702 and ``swiglu_limit`` 7.0); ``w2_weight`` ``[E, hidden, I/tp]`` plus ``w2_bias``
  ``[E, hidden]``, the routing weight applied after the bias.
- TP: the intermediate dim is sharded as for the others (vLLM slices the interleaved columns
  ``2 * start : 2 * end``); vLLM loads ``w2_bias`` on rank 0 only (zeros elsewhere), so the
  baseline is rank 0's partial sum, bias included.
- the clamp binds only on large pre-activations; with the default weights and N(0, 1)
  hidden states they are N(0, 1/3) and it never would, so the hidden states of these
  scenarios are drawn N(0, :data:`SWIGLU_INPUT_STD`^2): pre-activations of std ~3.5, the
  limit (7) binding on ~2 % of the gate and ~4 % of the up values (every token has some),
  and ``w2_weight`` drawn :data:`SWIGLU_W2_SCALE` times narrower, so the output's rms is
  ~0.1 as in the other MoE scenarios (the tolerance scales with the rms, so the size
  itself no longer matters). The biases are drawn of the size of what they are added to: ``w13_bias``
  U(-1, 1), ``w2_bias`` U(-0.1, 0.1). A kernel without the clamp is then ``incorrect`` on
  ~17 % of the elements, one without the up clamp on ~5 %, one without either bias too
  (``tests/operators/test_moe_gpt_oss.py``).

Llama-4 (``Llama4TextMoe``; semantics ``llama4``), as vLLM's ``Llama4MoE`` runs it
(``SharedFusedMoE`` with its ``custom_routing_function``, ``renormalize=False``,
``apply_router_weight_on_input=True``): the top-1 expert of the router logits, its weight
the sigmoid of that logit in fp32 (not renormalised); the token's hidden state times that
weight (rounded to the model dtype, as vLLM's ``prepare`` and transformers do) is the
expert's input, its output is not scaled again; the shared expert (``Llama4TextMLP``, of
width ``intermediate_size``, SiLU-gated: :class:`kb_nano.operators.moe_parts.SharedExperts`)
is added. Since SiLU is not linear, scaling the output instead changes it.

Phi-3.5-MoE (``PhimoeSparseMoeBlock``; semantics ``phimoe``), as vLLM's ``PhiMoE`` runs it
(``FusedMoE`` with ``custom_routing_function=phimoe_routing_function``,
``renormalize=False``): top-2 routing by :func:`kb_nano.operators.moe_parts.sparsemixer` in
eval mode (no noise) with ``jitter_eps`` = the config's ``router_jitter_noise``, computed in
the logits' dtype, the weights not renormalised; the experts as Mixtral's (SiLU-and-mul,
gate rows then up rows), weighted after ``w2``.

The bias is stored in the model dtype (every parameter of a baseline is cast to the
scenario dtype; vLLM keeps it in fp32) and drawn from N(0, :data:`SCORE_BIAS_STD`^2) with
the other weights; the router logits are N(0, 1): then the expert groups change the chosen
experts of ~85 % of the tokens against a plain top-k, and the bias those of ~99 %
against the same choice without it (256 experts, 8 groups, 4 kept, top-8), so a kernel
that ignores either fails.

TP: vLLM's ``FusedMoE`` without expert parallelism shards every expert's intermediate
dimension: ``w13_weight`` ``[E, 2 * I/tp, hidden]``, ``w2_weight`` ``[E, hidden, I/tp]``
with ``I = moe_intermediate_size`` (Qwen3-MoE) or ``intermediate_size`` (Mixtral). The
output is this rank's partial sum (the all-reduce is omitted, as in ``mlp``).

Traffic: minimum DRAM bytes = the weights of the experts the batch hits (expected number
under uniform routing, ``E * (1 - (1 - k/E)^N)``, rounded; plus the shared experts' and the
bias) + hidden states, router logits and output once; FLOPs = ``N * k * (2 * hidden * 2 I/tp
+ 2 * (I/tp) * hidden + 5 I/tp)`` (the GEMMs of the k experts of every token, as vLLM's
``benchmark_moe`` counts them, plus the activation), plus the same count of the shared
experts' width once per token.

Tolerance: class ``fused`` (bf16 atol 6e-2 x the output's rms, whose rms is ~0.04-0.15;
rtol 1.6e-2: :data:`kb_nano.operators.base.TOLERANCES`): each expert's activation is rounded and reduced again by ``w2``, and up to k expert
outputs are summed in the model dtype, in an order a fused kernel may change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kb_nano.operators.base import (
    DTYPES,
    TOLERANCES,
    NotApplicable,
    Operator,
    config_field,
    element_size,
    intermediate_size,
    moe_not_covered,
    normal,
    shard,
)
from kb_nano.operators.moe_args import SEMANTICS_ARGS, moe_semantics
from kb_nano.operators.moe_parts import SCORING_FUNCS, SharedExperts, fused_topk, grouped_topk, sparsemixer, swiglu_oai

# std of the e_score_correction_bias the baseline draws (DeepSeek-V3; see the module docstring)
SCORE_BIAS_STD = 0.05
# gpt-oss (swigluoai): std of the hidden states, and how many times narrower than the
# default w2_weight is drawn (see the module docstring)
SWIGLU_INPUT_STD = 6.0
SWIGLU_W2_SCALE = 30.0
ACTIVATIONS = ("silu", "swigluoai")
ROUTING_FUNCTIONS = (None, "sparsemixer")

# Architectures whose decoder MLPs are mixtures of experts (used when the expert fields of
# config.json are not at hand, e.g. `kernels --map`).
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "phimoe", "olmoe", "gpt_oss")


def num_experts(facts: dict) -> int:
    """Routed experts of the model (0 for a dense model)."""
    return int(config_field(facts, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)


def is_moe(facts: dict) -> bool:
    """True when the model's MLPs are mixtures of experts: read from its module tree
    (``facts['mlp_blocks']``, :func:`kb_nano.models.module_tree.mlp_blocks`) when the facts
    have it, else from the config's expert fields and model type."""
    if "mlp_blocks" in facts:
        return facts["mlp_blocks"]["moe"] is not None
    return num_experts(facts) > 0 or facts.get("model_type") in MOE_MODEL_TYPES


class FusedMoE(nn.Module):
    """Mixture-of-experts block of one TP rank with vLLM's ``FusedMoE`` signature.

    Args:
        num_experts: routed experts ``E``.
        top_k: experts per token (``num_experts_per_tok``).
        hidden_size: model hidden size.
        intermediate_size: one expert's (full, unsharded) intermediate size.
        params_dtype: dtype of the expert weights (torch dtype or its name; default float32).
        reduce_results: vLLM's all-reduce flag; the per-rank module never reduces.
        renormalize: rescale the top-k routing weights to sum 1.
        use_grouped_topk, num_expert_group, topk_group, scoring_func: vLLM's grouped top-k
            routing (:func:`kb_nano.operators.moe_parts.grouped_topk`); without
            ``use_grouped_topk`` the routing is ``fused_topk`` (softmax; sigmoid: Llama-4's
            sigmoid of the top-k logits).
        routed_scaling_factor: multiplies the routed experts' output (vLLM ``MoERunner``).
        e_score_correction_bias: hold a bias ``[E]`` added to the scores for the expert
            choice only (vLLM takes the gate's tensor; here a parameter of the block).
        shared_experts_intermediate_size: full width of the shared experts added to every
            token (0: none; vLLM ``SharedFusedMoE`` takes the ``shared_experts`` module).
        apply_router_weight_on_input: multiply each token's input to its expert by the
            routing weight, not the expert's output (vLLM's flag; Llama-4; top_k 1 only).
        custom_routing_function: the name of a routing function replacing ``fused_topk``
            (vLLM takes the function): ``sparsemixer`` (Phi-3.5-MoE; top_k 2, no renormalisation).
        jitter_eps: sparsemixer's threshold parameter (the config's ``router_jitter_noise``).
        has_bias: the experts have biases ``w13_bias`` and ``w2_bias`` (vLLM's flag; gpt-oss).
        tp_size: TP degree (kb-nano addition).
        prefix: layer name (unused).
        activation: ``silu`` (SiLU of the gate half times the up half) or ``swigluoai``
            (gpt-oss: :func:`kb_nano.operators.moe_parts.swiglu_oai`, gate/up rows interleaved).
        swiglu_alpha, swiglu_limit: the ``swigluoai`` constants (kb-nano additions; vLLM's
            are fixed at 1.702 and 7.0, gpt-oss's).
    Forward: hidden_states ``[N, hidden_size]``; router_logits ``[N, E]`` (the ``gate``
    output). Returns ``[N, hidden_size]`` in the hidden_states dtype.
    State dict: ``w13_weight`` ``[E, 2 * I/tp, hidden]`` (gate rows then up rows),
    ``w2_weight`` ``[E, hidden, I/tp]`` (vLLM's names and layouts); with a bias
    ``e_score_correction_bias`` ``[E]``; with shared experts ``shared_experts.gate_up_proj.weight``
    ``[2 * Is/tp, hidden]`` and ``shared_experts.down_proj.weight`` ``[hidden, Is/tp]``; with
    ``has_bias`` ``w13_bias`` ``[E, 2 * I/tp]`` and ``w2_bias`` ``[E, hidden]``.
    Raises ``ValueError`` for another activation or scoring function, a TP that does not
    divide a width, grouped top-k without groups that divide ``E``, the routing weight on
    the input with ``top_k`` > 1, or another routing function, or sparsemixer with ``top_k``
    other than 2, renormalisation or grouped top-k.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype | str | None = None,
        reduce_results: bool = False,
        renormalize: bool = True,
        use_grouped_topk: bool = False,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        scoring_func: str = "softmax",
        routed_scaling_factor: float = 1.0,
        e_score_correction_bias: bool = False,
        shared_experts_intermediate_size: int = 0,
        apply_router_weight_on_input: bool = False,
        custom_routing_function: str | None = None,
        jitter_eps: float = 0.01,
        has_bias: bool = False,
        tp_size: int = 1,
        prefix: str = "",
        activation: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} not supported; supported: {', '.join(ACTIVATIONS)}")
        if intermediate_size % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide intermediate_size={intermediate_size}")
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {scoring_func!r} not supported; supported: {', '.join(SCORING_FUNCS)}")
        if apply_router_weight_on_input and top_k != 1:
            raise ValueError(f"apply_router_weight_on_input needs top_k=1, not {top_k} (as vLLM)")
        if custom_routing_function not in ROUTING_FUNCTIONS:
            raise ValueError(
                f"custom_routing_function {custom_routing_function!r} not supported; supported: sparsemixer"
            )
        if custom_routing_function and (top_k != 2 or renormalize or use_grouped_topk):
            raise ValueError(
                f"sparsemixer routes top_k=2 without renormalize or grouped top-k (as vLLM), not top_k={top_k}, "
                f"renormalize={renormalize}, use_grouped_topk={use_grouped_topk}"
            )
        if use_grouped_topk and (not num_expert_group or not topk_group or num_experts % num_expert_group):
            raise ValueError(
                f"grouped top-k: num_expert_group={num_expert_group} must divide num_experts={num_experts}"
            )
        dtype = DTYPES[params_dtype] if isinstance(params_dtype, str) else (params_dtype or torch.float32)
        shard_size = intermediate_size // tp_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_size = tp_size
        self.grouping = (num_expert_group, topk_group, scoring_func) if use_grouped_topk else None
        self.scoring_func = scoring_func
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.custom_routing_function, self.jitter_eps = custom_routing_function, float(jitter_eps)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.swiglu = (float(swiglu_alpha), float(swiglu_limit)) if activation == "swigluoai" else None
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * shard_size, hidden_size, dtype=dtype))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, shard_size, dtype=dtype))
        # normal, of nn.Linear's default variance per expert (that of uniform +-1/sqrt(fan_in),
        # 1 / (3 fan_in)): trained weights are closer to normal than to uniform, and a
        # per-tensor int8 quantization of uniform weights loses little more than bf16 does
        # (see the module docstring)
        w2_std = (3 * shard_size) ** -0.5 / (SWIGLU_W2_SCALE if self.swiglu else 1.0)
        nn.init.normal_(self.w13_weight, std=(3 * hidden_size) ** -0.5)
        nn.init.normal_(self.w2_weight, std=w2_std)
        self.w13_bias = self.w2_bias = None
        if has_bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * shard_size, dtype=dtype))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
            # of the size of what they are added to (see the module docstring)
            nn.init.uniform_(self.w13_bias, -1.0, 1.0)
            nn.init.uniform_(self.w2_bias, -0.1, 0.1)
        self.e_score_correction_bias = None
        if e_score_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=dtype))
            nn.init.normal_(self.e_score_correction_bias, std=SCORE_BIAS_STD)
        self.shared_experts = None
        if shared_experts_intermediate_size:
            self.shared_experts = SharedExperts(hidden_size, shared_experts_intermediate_size, tp_size, dtype)

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights fp32 [N, k], topk_ids int64 [N, k])``: vLLM ``fused_topk``, or
        ``grouped_topk`` (without the scaling factor, applied to the output in ``forward``), or
        ``sparsemixer``."""
        if self.custom_routing_function == "sparsemixer":
            return sparsemixer(router_logits, self.jitter_eps)
        if self.grouping is None:
            return fused_topk(router_logits, self.top_k, self.renormalize, self.scoring_func)
        groups, keep, scoring = self.grouping
        return grouped_topk(
            router_logits, self.top_k, self.renormalize, groups, keep, scoring, 1.0, self.e_score_correction_bias
        )

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.select_experts(router_logits)
        out = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(topk_ids, num_classes=self.num_experts).permute(2, 1, 0)  # [E, k, N]
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            top_k_pos, token_idx = torch.where(expert_mask[e])
            h = hidden_states[token_idx]
            if self.apply_router_weight_on_input:  # Llama-4: the routing weight scales the input
                h = h * topk_weights[token_idx, top_k_pos, None].to(h.dtype)
            h = F.linear(h, self.w13_weight[e], _row(self.w13_bias, e))
            if self.swiglu is None:
                gate, up = h.chunk(2, dim=-1)
                h = F.silu(gate) * up
            else:
                h = swiglu_oai(h, *self.swiglu)
            h = F.linear(h, self.w2_weight[e], _row(self.w2_bias, e))
            if not self.apply_router_weight_on_input:
                h = h * topk_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        if self.routed_scaling_factor != 1.0:
            out = out * self.routed_scaling_factor
        if self.shared_experts is not None:
            out = self.shared_experts(hidden_states) + out
        return out


def _row(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    """Expert ``e``'s bias row, or None without biases."""
    return None if bias is None else bias[e]


def moe_intermediate_size(facts: dict) -> int:
    """One expert's intermediate size: ``moe_intermediate_size`` (Qwen-MoE) or
    ``intermediate_size`` (Mixtral)."""
    width = config_field(facts, "moe_intermediate_size")
    return int(width) if width is not None else intermediate_size(facts)


def _init_args(facts: dict, tp: int) -> dict:
    if moe_not_covered(facts):
        raise NotApplicable(moe_not_covered(facts))
    e = num_experts(facts)
    top_k = config_field(facts, "num_experts_per_tok")
    if not e or not top_k:
        raise NotApplicable("expert fields of config.json not available (num_experts, num_experts_per_tok)")
    semantics = moe_semantics(facts)
    if facts["hidden_act"] != "silu" and semantics != "gpt_oss":
        raise NotApplicable(
            f"not covered: hidden_act {facts['hidden_act']!r} is not implemented by the baseline (silu)"
        )
    inter = moe_intermediate_size(facts)
    shard(inter, tp, "moe intermediate_size")
    extra = SEMANTICS_ARGS[semantics](facts, tp) if semantics in SEMANTICS_ARGS else {}
    return {
        "num_experts": e,
        "top_k": int(top_k),
        "hidden_size": facts["hidden_size"],
        "intermediate_size": inter,
        "params_dtype": facts["dtype"],
        "renormalize": bool(config_field(facts, "norm_topk_prob", default=True)),
        **extra,
        "tp_size": tp,
    }


def _inputs(args, facts, tp, num_tokens, dtype):
    std = SWIGLU_INPUT_STD if args.get("activation") == "swigluoai" else 1.0
    return [
        normal("hidden_states", [num_tokens, args["hidden_size"]], dtype, std=std),
        normal("router_logits", [num_tokens, args["num_experts"]], dtype),
    ]


def _traffic(args, inputs, dtype):
    n, h = inputs[0]["shape"]
    es, ws = element_size(inputs[0]["dtype"]), element_size(args["params_dtype"])
    e, k, tp = args["num_experts"], args["top_k"], args["tp_size"]
    i = args["intermediate_size"] // tp
    shared = args.get("shared_experts_intermediate_size", 0) // tp
    experts_hit = max(1, round(e * (1 - (1 - k / e) ** n)))
    weights = (experts_hit * i + shared) * 3 * h + (e if args.get("e_score_correction_bias") else 0)
    weights += experts_hit * (2 * i + h) if args.get("has_bias") else 0
    flops = (n * k * i + n * shared) * (2 * h * 2 + 2 * h + 5)
    return weights * ws + (2 * n * h + n * e) * es, flops


OPERATORS = {
    "fused_moe": Operator(
        name="fused_moe",
        level=2,
        category="moe",
        baseline=FusedMoE,
        init_args=_init_args,
        inputs=_inputs,
        traffic=_traffic,
        used_in="layers.*.mlp.experts / block_sparse_moe.experts (after the router gate; MoE models)",
        applies_to=is_moe,
        reads_module_tree=True,
        semantics=moe_semantics,
        tolerance=dict(TOLERANCES["fused"]),
    ),
}
