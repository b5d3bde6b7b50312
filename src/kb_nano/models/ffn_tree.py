"""The feed-forward blocks of a model's own transformers modules (part of
:func:`kb_nano.models.module_tree.read`): each decoder layer's dense gated MLPs (width,
activation) and its MoE block, which is covered only when its class is one the
``fused_moe`` baseline is tested equal to (:data:`COVERED_MOE`), each with the semantics of
its scenarios. The experts of an MoE block are read too (:func:`experts_facts`): their
activation (SiLU-and-mul from the ``act_fn`` module, or gpt-oss's clamped SwiGLU, probed on
the CPU against :func:`kb_nano.operators.moe_parts.swiglu_oai`) and whether they have biases.
"""

from __future__ import annotations

import copy
import re

import torch

from kb_nano.models.attention_tree import LAYER_LISTS

# The MoE blocks whose routing and experts the ``fused_moe`` baseline computes (it is
# tested equal to them), each with the semantics of its scenarios: softmax top-k routing with
# optional renormalisation and SiLU-gated experts (the standard form, ""); DeepSeek-V3's
# grouped sigmoid top-k with a correction bias, scaling and shared experts ("deepseek_v3");
# gpt-oss's softmax over the top-k logits and biased experts with the clamped SwiGLU ("gpt_oss");
# Llama-4's sigmoid of the top-1 logit scaling the expert's input, plus a shared expert ("llama4");
# Phi-3.5-MoE's sparsemixer top-2 routing (eval mode) and SiLU-gated experts ("phimoe")
COVERED_MOE = {
    "MixtralSparseMoeBlock": "",
    "Qwen3MoeSparseMoeBlock": "",
    "DeepseekV3MoE": "deepseek_v3",
    "GptOssMLP": "gpt_oss",
    "Llama4TextMoe": "llama4",
    "PhimoeSparseMoeBlock": "phimoe",
}
# the experts' activation each semantics computes (:func:`experts_facts`' ``act``)
SEMANTICS_ACT = {"": "silu", "deepseek_v3": "silu", "gpt_oss": "swigluoai", "llama4": "silu", "phimoe": "silu"}


def activation_name(module: torch.nn.Module) -> str | None:
    """``silu``, ``gelu_tanh`` or ``gelu`` (exact, erf) for a transformers activation module
    (``SiLUActivation``, ``nn.SiLU``; ``GELUTanh``, ``PytorchGELUTanh``; others probed:
    ``GELUActivation`` of ``hidden_act`` ``gelu`` is exact, ``NewGELUActivation`` of
    ``gelu_new`` the tanh form), else None. Probed on :data:`PROBE_WIDTH` values in [-6, 6]
    on the CPU against ``F.silu`` and ``F.gelu`` with each ``approximate`` (the two GELUs
    differ by up to 5e-4 there; the probe's tolerance is 1e-6)."""
    name = type(module).__name__
    if "SiLU" in name:
        return "silu"
    if "GELUTanh" in name:
        return "gelu_tanh"
    probe = torch.linspace(-6.0, 6.0, PROBE_WIDTH, dtype=torch.float64)
    try:
        with torch.no_grad():
            out = copy.deepcopy(module).to_empty(device="cpu")(probe)
    except Exception:  # noqa: BLE001 - any failure of the module's own code: not one of these
        return None
    F = torch.nn.functional
    forms = {"silu": F.silu(probe), "gelu_tanh": F.gelu(probe, approximate="tanh"), "gelu": F.gelu(probe)}
    same = [k for k, want in forms.items() if isinstance(out, torch.Tensor) and torch.allclose(out, want, atol=1e-6)]
    return same[0] if same else None


def experts_facts(experts: torch.nn.Module) -> dict:
    """What the experts module of an MoE block (meta device) computes between its two
    GEMMs, and whether they have biases: ``{"act", "bias"}``, plus ``swiglu_alpha`` and
    ``swiglu_limit`` for gpt-oss's clamped SwiGLU. ``act``: :func:`activation_name` of its
    ``act_fn`` module (``silu``: SiLU of the gate half times the up half); ``swigluoai``
    for a module with ``alpha``, ``limit`` and an ``_apply_gate`` that equals
    :func:`kb_nano.operators.moe_parts.swiglu_oai` on a probe of :data:`PROBE_WIDTH`
    interleaved values in [-12, 12] (past the limit), on the CPU; None otherwise.
    ``bias``: it has a ``gate_up_proj_bias`` or ``down_proj_bias`` parameter."""
    from kb_nano.operators.moe_parts import swiglu_oai

    bias = any(isinstance(getattr(experts, n, None), torch.nn.Parameter) for n in EXPERT_BIASES)
    act_fn = getattr(experts, "act_fn", None)
    if act_fn is not None:
        return {"act": activation_name(act_fn), "bias": bias}
    alpha, limit, gate = (getattr(experts, n, None) for n in ("alpha", "limit", "_apply_gate"))
    if not isinstance(alpha, float | int) or not isinstance(limit, float | int) or not callable(gate):
        return {"act": None, "bias": bias}
    probe = torch.linspace(-12.0, 12.0, PROBE_WIDTH)[None]
    try:
        same = torch.allclose(gate(probe), swiglu_oai(probe, float(alpha), float(limit)), atol=1e-6)
    except Exception:  # noqa: BLE001 - any failure of the module's own code: not this activation
        same = False
    facts = {"act": "swigluoai" if same else None, "bias": bias}
    return facts | ({"swiglu_alpha": float(alpha), "swiglu_limit": float(limit)} if same else {})


EXPERT_BIASES = ("gate_up_proj_bias", "down_proj_bias")
PROBE_WIDTH = 64

# a decoder layer's feed-forward child, by the names transformers' decoder layers give it
FFN_NAMES = ("mlp", "feed_forward", "block_sparse_moe")
# an MoE block's router child, by the names transformers' MoE blocks give it (Mixtral,
# Qwen3-MoE, DeepSeek-V3: ``gate``; gpt-oss, Llama-4, Phi-3.5-MoE: ``router``)
ROUTER_NAMES = ("gate", "router")


def moe_router(block: torch.nn.Module) -> torch.nn.Module | None:
    """The child of the MoE block ``block`` that computes its router logits: the first of
    :data:`ROUTER_NAMES` with a 2-D ``weight`` ``[experts, hidden]`` (and an optional
    ``bias`` ``[experts]``: the logits are ``F.linear(x, weight, bias)`` whatever the
    router's forward returns); None for a block without experts or such a child."""
    if not isinstance(getattr(block, "experts", None), torch.nn.Module):
        return None
    for name in ROUTER_NAMES:
        router = getattr(block, name, None)
        weight = getattr(router, "weight", None)
        if isinstance(router, torch.nn.Module) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return router
    return None


def mlp_blocks(lm: torch.nn.Module) -> dict:
    """The feed-forward blocks of the causal LM ``lm`` (meta device), from each decoder
    layer's ``mlp`` (or ``feed_forward``, :data:`FFN_NAMES`): ``{"dense": [{"where",
    "class", "intermediate_size", "act", "act_class", "gated", "bias", "layers"}, ...],
    "moe": {"class", "semantics", "reason", "experts"} | None}``. A dense entry per
    distinct MLP (``where``: ``mlp`` for a layer's own MLP, ``shared_experts`` for an
    MoE block's always-on experts; ``intermediate_size`` from its ``up_proj`` or fused
    ``gate_up_proj``; ``act`` from :func:`activation_name`; ``gated``: it has a
    ``gate_proj`` or ``gate_up_proj``, else it computes ``down(act(up(x)))``, as Arcee's
    and Nemotron's; ``bias``: its projections have biases, Llama's ``mlp_bias``;
    ``scaled``: its ``*multiplier`` attributes other than 1, Falcon-H1's); ``moe`` is the first MoE
    block (an ``mlp`` with ``experts``: :func:`moe_block`); None for a dense model. A model with neither
    gets an MoE entry without class whose reason says none was found."""
    dense: dict[tuple, dict] = {}
    moe = None

    def add(module: torch.nn.Module, where: str) -> None:
        children = dict(module.named_children())
        meta_act = w123_activation(module)  # Lfm2's w1 / w3 / w2, probed
        if meta_act is not None:
            children = {"gate_proj": module.w1, "up_proj": module.w3, "down_proj": module.w2}
        if "up_proj" in children:
            width = int(children["up_proj"].out_features)
        elif "gate_up_proj" in children:
            width = int(children["gate_up_proj"].out_features) // 2
        else:
            width = None
        act = children.get("act_fn", children.get("activation_fn"))
        gated = "gate_proj" in children or "gate_up_proj" in children
        projections = [children[n] for n in ("gate_proj", "up_proj", "gate_up_proj", "down_proj") if n in children]
        bias = any(getattr(p, "bias", None) is not None for p in projections)
        # scale factors inside the block (Falcon-H1: act(gate * m) * up, down(...) * m)
        scaled = tuple(
            f"{n}={v:g}"
            for n, v in sorted(vars(module).items())
            if n.endswith("multiplier") and isinstance(v, int | float) and not isinstance(v, bool) and v != 1
        )
        act_class = type(act).__name__ if act is not None else None
        if meta_act is not None:
            act_class = f"{meta_act} (probed)"
        key = (where, type(module).__name__, width, act_class, gated, bias, scaled)
        entry = dense.setdefault(
            key,
            {
                "where": where,
                "class": key[1],
                "intermediate_size": width,
                "act": meta_act or (activation_name(act) if act is not None else None),
                "act_class": key[3],
                "gated": gated,
                "bias": bias,
                "scaled": list(scaled),
                "layers": 0,
            },
        )
        entry["layers"] += 1

    in_layer = re.compile(rf"(^|\.){LAYER_LISTS}\.\d+\.[^.]+$")  # a decoder layer's own child
    for name, module in lm.named_modules():
        if name.rsplit(".", 1)[-1] not in FFN_NAMES or not in_layer.search(name):
            continue
        children = dict(module.named_children())
        if "experts" not in children:
            add(module, "mlp")
            continue
        for sub in ("shared_experts", "shared_expert"):
            if sub in children:
                add(children[sub], "shared_experts")
        if moe is None:
            moe = moe_block(module)
    if not dense and moe is None:
        where = "a decoder layer's " + " / ".join(FFN_NAMES)
        reason = f"not covered: no feed-forward block found ({where})"
        moe = {"class": None, "semantics": "", "reason": reason, "experts": None}
    return {"dense": list(dense.values()), "moe": moe}


# The gated MLP of Meta's original naming (Llama's reference code, Lfm2): ``w2(act(w1(x)) * w3(x))``
W123 = ("w1", "w2", "w3")


def w123_activation(meta_module: torch.nn.Module) -> str | None:
    """For an MLP whose children are exactly the ``nn.Linear`` layers ``w1``, ``w2``, ``w3``
    (gate, down, up: Lfm2's ``Lfm2MLP``): the activation ``act`` (``silu``, ``gelu_tanh``,
    ``gelu``) for which it computes ``w2(act(w1(x)) * w3(x))``, probed on the CPU with
    random weights on :data:`PROBE_WIDTH` random rows (float64, tolerance 1e-9); None for
    other modules or other computations. The names alone do not say which of w1 and w3 is
    the gate: the probe does."""
    F = torch.nn.functional
    children = dict(meta_module.named_children())
    if sorted(children) != list(W123) or not all(isinstance(c, torch.nn.Linear) for c in children.values()):
        return None
    module = copy.deepcopy(meta_module).to_empty(device="cpu").double()
    gen = torch.Generator().manual_seed(0)
    acts = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        x = torch.randn(PROBE_WIDTH, module.w1.in_features, generator=gen, dtype=torch.float64)
        try:
            out = module(x)
        except Exception:  # noqa: BLE001 - any failure of the module's own code: not this form
            return None
        for name, act in acts.items():
            want = module.w2(act(module.w1(x)) * module.w3(x))
            if isinstance(out, torch.Tensor) and out.shape == want.shape and torch.allclose(out, want, atol=1e-9):
                return name
    return None


def moe_block(module: torch.nn.Module) -> dict:
    """The MoE block ``module`` (meta device; a feed-forward block with ``experts``):
    ``{"class", "semantics", "reason", "experts"}``; ``semantics`` from
    :data:`COVERED_MOE`, ``experts`` from :func:`experts_facts`, ``reason`` None when the
    class is covered and its experts compute the activation its semantics take
    (:data:`SEMANTICS_ACT`), else ``not covered: ...``."""
    cls = type(module).__name__
    children = dict(module.named_children())
    experts = experts_facts(children["experts"])
    semantics = COVERED_MOE.get(cls, "")
    reason = None
    if cls not in COVERED_MOE:
        extra = sorted(set(children) - {"experts", "gate"})
        has = f"; it has {', '.join(extra)}" if extra else ""
        reason = (
            f"not covered: {cls} (its routing and experts are not those of "
            f"{' / '.join(COVERED_MOE)} that the baseline computes{has})"
        )
    elif experts["act"] != SEMANTICS_ACT[semantics]:
        reason = f"not covered: {cls} whose experts' activation is not {SEMANTICS_ACT[semantics]}"
    return {"class": cls, "semantics": semantics, "reason": reason, "experts": experts}
