"""The norm half of the module tree: the hidden-size RMSNorm's form (Llama's or Gemma's),
the per-head q/k norms, the LayerNorms, and how a decoder layer adds its residual around
its norms, each read from (and probed on) the model's own modules; by
:func:`kb_nano.models.module_tree.read`."""

from __future__ import annotations

import copy

import torch

from kb_nano.models.attention_tree import PROBE_ROWS, attention_modules, first_decoder_layer, qk_norm_names

# weight offsets of the hidden-size RMSNorm forms kb-nano measures: output = x / rms(x) * (offset + w)
NORM_FORMS = {0.0: "x / rms(x) * weight (LlamaRMSNorm)", 1.0: "x / rms(x) * (1 + weight) (GemmaRMSNorm)"}


def hidden_size(lm: torch.nn.Module) -> int:
    """The hidden size of the causal LM ``lm``, read through its transformers config object
    (which resolves its class's ``attribute_map``: GPT-2's ``n_embd``, MPT's ``d_model``)."""
    return int(lm.config.hidden_size)


def residual_add(config_fields: dict, lm: torch.nn.Module) -> dict:
    """How the first decoder layer of ``lm`` (meta device) adds its residual around its
    hidden-size norms: ``{"form": "pre_norm", "reason": None}`` when it has an
    ``input_layernorm`` (the residual is added, then normalised: vLLM's
    ``fused_add_rms_norm``); ``"post_norm"`` when it has none (Olmo-2, Exaone-4: each
    norm runs on a sublayer's output and the residual is added after it, no fused add);
    ``"scaled"`` when the config scales the sublayer's output before the add
    (:data:`RESIDUAL_SCALES`; Granite: ``residual + h * m``, which vLLM adds in torch
    before a plain RMSNorm). A pre-norm layer's first norm is one of :data:`PRE_NORM_NAMES`. ``reason`` says why for the last two."""
    layer = first_decoder_layer(lm)
    if layer is None:
        return {"form": "pre_norm", "reason": None}
    cls = type(layer).__name__
    if not set(dict(layer.named_children())) & set(PRE_NORM_NAMES):
        return {"form": "post_norm", "reason": f"{cls} has no input_layernorm: its residual is added after each norm"}
    for field in RESIDUAL_SCALES:  # (the config object's: its class's default when the file has none)
        scale = getattr(lm.config, field, None)
        if isinstance(scale, int | float) and float(scale) != 1.0:
            reason = f"not covered: {cls} adds residual + h * (its {field}, {scale}) before its norm"
            return {"form": "scaled", "reason": reason}
    return {"form": "pre_norm", "reason": None}


# The names of a pre-norm layer's norm before its attention: Llama's ``input_layernorm``,
# Apertus' ``attention_layernorm``, Lfm2's ``operator_norm``
PRE_NORM_NAMES = ("input_layernorm", "attention_layernorm", "operator_norm")
# config fields that scale a sublayer's output before the residual add: Granite's
# ``residual_multiplier``, MiniCPM's ``scale_depth`` (times 1 / sqrt(num_hidden_layers))
RESIDUAL_SCALES = ("residual_multiplier", "scale_depth")


def layer_norm(config_fields: dict, lm: torch.nn.Module) -> dict | None:
    """The hidden-size ``torch.nn.LayerNorm`` of the model (Phi-3.5-MoE's ``input_layernorm``,
    ``post_attention_layernorm`` and final ``norm``; vLLM builds the same ``nn.LayerNorm``):
    ``{"class", "eps", "bias"}`` of the first such module of ``lm`` (the model on the meta
    device) that is a decoder layer's direct child or the base model's (the final norm:
    ``norm``, Falcon's ``ln_f``; not a vision tower's), or None when it has none. ``eps`` is the module's own (Phi-3.5-MoE passes
    ``rms_norm_eps``), ``bias`` whether it has one. Raises nothing; a model whose LayerNorms
    disagree in ``eps`` or bias gets the first one's (none of the vendored models)."""
    import re

    hidden = hidden_size(lm)
    for name, module in lm.named_modules():
        # a decoder layer's own norms (``layers.<i>``, Falcon's ``h.<i>``) and a direct child of
        # the base model (the final ``norm``, Falcon's ``ln_f``, GPT-NeoX's ``final_layer_norm``);
        # not a vision tower's
        if not re.search(r"(^|\.)(layers|h)\.\d+\.[^.]+$|^[^.]+\.[^.]+$", name) or "vision" in name:
            continue
        if isinstance(module, torch.nn.LayerNorm) and tuple(module.normalized_shape) == (hidden,):
            if module.elementwise_affine:
                found = {"class": type(module).__name__, "eps": float(module.eps), "bias": module.bias is not None}
                if not _computes_layer_norm(module, hidden):  # a subclass with its own forward
                    found["reason"] = f"not covered: {found['class']} computes something else than F.layer_norm"
                return found
    return None


def _computes_layer_norm(meta_module: torch.nn.LayerNorm, hidden: int) -> bool:
    """Whether the LayerNorm (sub)class ``meta_module`` (meta device) computes
    ``F.layer_norm(x, weight, bias, eps)``: probed on the CPU with a random weight and bias
    on :data:`PROBE_ROWS` random rows (Nemotron's ``LayerNorm1P`` uses ``weight + 1``)."""
    module = copy.deepcopy(meta_module).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, hidden, generator=gen)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        try:
            out = module(x)
        except Exception:
            return False
        want = torch.nn.functional.layer_norm(x, (hidden,), module.weight, module.bias, module.eps)
    return isinstance(out, torch.Tensor) and out.shape == want.shape and torch.allclose(out, want, rtol=1e-4, atol=1e-5)


def qk_norm(lm: torch.nn.Module) -> dict | None:
    """The per-head q/k norm of the causal LM ``lm`` (meta device), from the first
    decoder layer's attention module with ``q_norm`` and ``k_norm`` children (Qwen3,
    Gemma-3; or as :func:`qk_norm_names` finds them otherwise named: Lfm2's
    ``q_layernorm``, HunYuan's ``query_layernorm``): ``{"class", "weight_offset", "reason"}`` as :func:`hidden_norm` gives it
    (the form probed on ``q_norm``, whose ``weight`` is ``[head_dim]``; ``not covered``
    when ``q_norm`` or ``k_norm`` has a weight of another size: Olmo-2 normalises the
    whole projection, ``[heads * head_dim]``); or with one
    ``qk_norm`` child applied to q and to k (Llama-4's ``Llama4TextL2Norm``, on its layers
    with rotation): ``{"class", "weight_offset": 0.0, "has_weight": False, "reason"}``
    when it is a weightless RMSNorm (:func:`weightless_norm`); None when the model has
    no such norms."""
    for module in attention_modules(lm):
        names = qk_norm_names(module)
        if names:
            norm, k_norm = (getattr(module, n) for n in names)
            cls = type(norm).__name__
            weight = getattr(norm, "weight", None)
            head_dim = getattr(module, "head_dim", None)
            sizes = [getattr(getattr(n, "weight", None), "shape", None) for n in (norm, k_norm)]
            if isinstance(head_dim, int) and any(s is not None and tuple(s) != (head_dim,) for s in sizes):
                shown = " and ".join(f"[{', '.join(map(str, s))}]" for s in sizes if s is not None)
                if any(s is not None and len(s) == 2 and s[-1] == head_dim for s in sizes):  # Cohere
                    what = "has a weight of its own for each head"
                else:
                    what = "normalises the whole q/k projection, not each head (Olmo-2's form)"
                reason = (
                    f"not covered: {cls} {what} (weights {shown}); kb-nano's qk_norm shares one "
                    f"[{head_dim}] weight across the heads"
                )
                return {"class": cls, "weight_offset": None, "reason": reason}
            offset = norm_offset(norm, weight.shape[0]) if isinstance(weight, torch.Tensor) else None
            if offset is None or type(k_norm) is not type(norm):
                reason = f"not covered: {cls} computes neither {' nor '.join(NORM_FORMS.values())}"
                return {"class": cls, "weight_offset": None, "reason": reason}
            return {"class": cls, "weight_offset": offset, "reason": None, "eps": module_eps(norm)}
        if isinstance(getattr(module, "qk_norm", None), torch.nn.Module):
            cls = type(module.qk_norm).__name__
            if weightless_norm(module.qk_norm, int(module.head_dim)):
                eps = module_eps(module.qk_norm)
                return {"class": cls, "weight_offset": 0.0, "has_weight": False, "reason": None, "eps": eps}
            reason = f"not covered: {cls} is not x * rsqrt(mean(x^2) + eps) without a weight"
            return {"class": cls, "weight_offset": None, "has_weight": False, "reason": reason}
    return None


def weightless_norm(meta_module: torch.nn.Module, size: int) -> bool:
    """Whether ``meta_module`` (meta device) has no parameters and computes ``x *
    rsqrt(mean(x^2) + eps)`` over its last dimension (``eps`` from its ``eps`` or
    ``variance_epsilon``, else 1e-6): probed on the CPU on :data:`PROBE_ROWS` random rows
    of ``size`` float32 values (relative tolerance 1e-4)."""
    if any(True for _ in meta_module.parameters()):
        return False
    module = copy.deepcopy(meta_module).to_empty(device="cpu")
    x = torch.randn(PROBE_ROWS, size, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            out = module(x)
    except Exception:
        return False
    eps = float(getattr(module, "eps", getattr(module, "variance_epsilon", 1e-6)))
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return isinstance(out, torch.Tensor) and out.shape == x.shape and torch.allclose(out, normed, rtol=1e-4, atol=1e-5)


def hidden_norm(config_fields: dict, lm: torch.nn.Module | None = None) -> dict:
    """The hidden-size RMSNorm of the model whose config.json fields are ``config_fields``:
    ``{"class": <transformers class name>, "weight_offset": 0.0 | 1.0 | None, "reason":
    str | None}``. Every module of the tree whose class name ends in ``RMSNorm`` and whose
    ``weight`` is ``[hidden_size]`` is probed (:func:`norm_offset`); ``weight_offset`` is
    None, with the reason, when they disagree, compute neither form of :data:`NORM_FORMS`,
    or the model has none (``class`` None). ``lm``: the model built on the meta device
    (default: built here with one layer; :func:`read` passes its own). A config
    transformers cannot build gives ``weight_offset`` None and the reason."""
    if lm is None:
        from kb_nano.operators.base import NotApplicable
        from kb_nano.operators.hf_modules import _meta_causal_lm, hf_config

        try:
            lm = _meta_causal_lm(hf_config(copy.deepcopy(config_fields), num_hidden_layers=1))
        except NotApplicable as exc:
            return {"class": None, "weight_offset": None, "reason": f"not covered: {exc}"}
    hidden = hidden_size(lm)
    found: dict[str, float | None] = {}
    eps: dict[str, float | None] = {}
    other: set[str] = set()  # hidden-size norms of other kinds (LayerNorm)
    for module in lm.modules():
        name = type(module).__name__
        weight = getattr(module, "weight", None)
        if "Norm" not in name or not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (hidden,):
            continue
        if not name.endswith("RMSNorm"):
            other.add(name)
        elif name not in found:
            found[name], eps[name] = norm_offset(module, hidden), module_eps(module)
    if not found:
        kinds = f" (its norms: {', '.join(sorted(other))})" if other else ""
        return {"class": None, "weight_offset": None, "reason": f"not covered: the model has no RMSNorm{kinds}"}
    offsets = set(found.values())
    first = next(iter(found))
    if None in offsets:
        bad = next(n for n, v in found.items() if v is None)
        return {
            "class": bad,
            "weight_offset": None,
            "reason": f"not covered: {bad} computes neither {' nor '.join(NORM_FORMS.values())}",
        }
    if len(offsets) > 1:
        return {
            "class": first,
            "weight_offset": None,
            "reason": f"not covered: the model's norms differ ({', '.join(sorted(found))})",
        }
    return {"class": first, "weight_offset": offsets.pop(), "reason": None, "eps": eps[first]}


def module_eps(module: torch.nn.Module) -> float | None:
    """A norm module's epsilon (``variance_epsilon`` or ``eps``), None when it has neither."""
    value = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(value) if isinstance(value, int | float) else None


def norm_offset(meta_module: torch.nn.Module, hidden: int) -> float | None:
    """Which form of :data:`NORM_FORMS` the RMSNorm ``meta_module`` (on the meta device)
    computes: a CPU copy with a random ``weight`` is run on :data:`PROBE_ROWS` random rows
    of ``hidden`` float32 values and compared with ``x * rsqrt(mean(x^2) + eps) * (offset
    + weight)`` for each offset (``eps`` from the module's ``variance_epsilon`` or ``eps``,
    else 1e-6; relative tolerance 1e-4). Returns the offset, or None for neither (or a
    module whose forward fails on one tensor)."""
    module = copy.deepcopy(meta_module).to_empty(device="cpu").float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        x = torch.randn(PROBE_ROWS, hidden, generator=gen)
        try:
            out = module(x)
        except Exception:
            return None
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            return None
        eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        for offset in NORM_FORMS:
            if torch.allclose(out, normed * (offset + module.weight), rtol=1e-4, atol=1e-5):
                return offset
    return None
