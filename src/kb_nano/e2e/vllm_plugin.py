"""The kb-nano vLLM general plugin: Tier-1 candidates swapped into the vLLM engine.

vLLM calls every entry point of the group ``vllm.general_plugins`` in each of its
processes (the front end, the engine core and every worker; ``vllm.plugins``); kb-nano
registers :func:`register` there (``pyproject.toml``). It does nothing unless
``KB_NANO_E2E_CANDIDATES`` names candidate files, so installing kb-nano never changes a
plain vLLM run. With candidates named, it registers, through vLLM's
``CustomOp.register_oot(name=<vLLM class name>)``, an adapter subclass of the vLLM layer
for each class a candidate maps to (:data:`SWAPS`). ``CustomOp.__new__`` then builds the
adapter wherever a model builds that vLLM class. The adapter keeps the vLLM layer's own
parameters (so vLLM's weight loading is untouched), builds the candidate module (the
Tier-1 file, unchanged) with the layer's constructor arguments, ties the candidate's
parameters to the layer's by name, and sends ``forward`` to the candidate.

Swappable (target -> vLLM class):

- ``rms_norm`` -> ``RMSNorm`` called without ``residual``;
  ``fused_add_rms_norm`` -> ``RMSNorm`` called with ``residual`` (vLLM's fused path).
- ``silu_and_mul`` -> ``SiluAndMul``; ``gelu_and_mul`` -> ``GeluAndMul``.
- ``rotary_embedding`` -> ``RotaryEmbedding`` and ``Llama3RotaryEmbedding`` (its scaling
  arguments become the baseline's ``rope_scaling`` mapping).

An ``RMSNorm`` that vLLM builds with ``has_weight=False`` or ``var_hidden_size`` (no
kb-nano baseline has those) keeps vLLM's forward; :func:`swappable` lists what is not
swappable and why.

Evidence for the benchmark row (directory ``KB_NANO_E2E_CALLS_DIR``, one JSON file per
process, ``calls-{pid}.json``): how many adapters each candidate got (``constructed``),
and how many eager forward calls it served (``calls``; rewritten at 1, 2, 4, 8, ... calls
and at exit, so the count read after a process is killed is a lower bound; calls inside
a ``torch.compile`` trace are not counted, a compiled graph runs the candidate without
re-entering Python). An exception inside a candidate's constructor or forward, or a
candidate file that does not import, is written to ``error-{pid}.json`` (candidate id,
one-line error, traceback) before it propagates into vLLM, so the job can tell a
candidate failure from an engine failure.
"""

from __future__ import annotations

import atexit
import json
import os
import traceback
from pathlib import Path

ENV_CANDIDATES = "KB_NANO_E2E_CANDIDATES"  # JSON list of {"id": "target/name", "path": "/abs/file.py"}
ENV_CALLS_DIR = "KB_NANO_E2E_CALLS_DIR"
PLUGIN_NAME = "kb_nano"  # the entry point name; VLLM_PLUGINS=kb_nano loads only this plugin

# target -> vLLM classes it replaces.
SWAPS = {
    "rms_norm": ("RMSNorm",),
    "fused_add_rms_norm": ("RMSNorm",),
    "silu_and_mul": ("SiluAndMul",),
    "gelu_and_mul": ("GeluAndMul",),
    "rotary_embedding": ("RotaryEmbedding", "Llama3RotaryEmbedding"),
}
NOT_SWAPPABLE = {
    "qk_norm": "vLLM's Qwen3 attention holds two separate RMSNorm modules (q_norm, k_norm), "
    "not one layer; those RMSNorms take the rms_norm candidate",
    "embedding": "VocabParallelEmbedding is a PluggableLayer whose weight is vocab-sharded and "
    "padded by vLLM; the baseline's [num_tokens] -> [num_tokens, hidden] module does not hold that layout",
    "lm_head": "ParallelLMHead runs through vLLM's quantization method and logits processor, not a forward",
    "sampler": "vLLM's sampler is not a CustomOp and draws its own random numbers",
    "attention": "vLLM attention is a backend (paged KV cache, block tables, metadata builders); the "
    "kb-nano attention operator works on a dense KV cache, so there is no clean backend to register",
    "mlp": "LlamaMLP-style blocks are plain modules built from vLLM's parallel linear layers, not CustomOps",
    "layer_norm": "vLLM builds Phi-3.5-MoE's norms as torch.nn.LayerNorm, not a CustomOp",
    "swigluoai_and_mul": "vLLM's fused_experts calls the swigluoai_and_mul kernel itself (torch.ops._C, "
    "activation='swigluoai'), not through the SwigluOAIAndMul layer, so no layer swap reaches it",
    "fused_moe": "FusedMoE's expert weights and quantization methods use vLLM's own layout (w13/w2)",
    "decoder_layer": "decoder layers are plain vLLM modules (no out-of-tree registration point)",
    "model": "the model class is chosen by vLLM's model registry, not a CustomOp",
}

_STATE = {"constructed": {}, "calls": {}, "next_flush": {}, "registered": False}


def swappable(target: str) -> tuple[bool, str]:
    """``(True, vLLM class names)`` if a candidate of ``target`` can run inside vLLM,
    else ``(False, reason)``."""
    if target in SWAPS:
        return True, ", ".join(SWAPS[target])
    return False, NOT_SWAPPABLE.get(target, "no vLLM layer maps to this kb-nano operator")


def active_from_env() -> list[dict]:
    """The candidates named by ``KB_NANO_E2E_CANDIDATES`` (``[]`` when unset or empty).
    Raises ``ValueError`` for malformed JSON or a target that is not swappable."""
    raw = os.environ.get(ENV_CANDIDATES, "").strip()
    if not raw:
        return []
    items = json.loads(raw)
    for item in items:
        target = item["id"].split("/", 1)[0]
        ok, why = swappable(target)
        if not ok:
            raise ValueError(f"{item['id']}: target {target} cannot be swapped into vLLM: {why}")
    return items


# ----------------------------------------------------------------------------- evidence files


def _calls_dir() -> Path | None:
    value = os.environ.get(ENV_CALLS_DIR)
    return Path(value) if value else None


def _flush() -> None:
    directory = _calls_dir()
    if directory is None:
        return
    from kb_nano.files import atomic_write_text

    doc = {"pid": os.getpid(), "constructed": _STATE["constructed"], "calls": _STATE["calls"]}
    atomic_write_text(directory / f"calls-{os.getpid()}.json", json.dumps(doc, sort_keys=True) + "\n")


def _record_error(candidate_id: str, where: str, exc: BaseException) -> None:
    directory = _calls_dir()
    if directory is None:
        return
    from kb_nano.candidates import one_line
    from kb_nano.files import atomic_write_text

    doc = {
        "pid": os.getpid(),
        "candidate": candidate_id,
        "where": where,
        "error": one_line(exc),
        "traceback": "".join(traceback.format_exception(exc))[-8000:],
    }
    atomic_write_text(directory / f"error-{os.getpid()}.json", json.dumps(doc, sort_keys=True) + "\n")


def _count(candidate_id: str) -> None:
    import torch

    if torch.compiler.is_compiling():
        return
    n = _STATE["calls"].get(candidate_id, 0) + 1
    _STATE["calls"][candidate_id] = n
    if n >= _STATE["next_flush"].get(candidate_id, 1):
        _STATE["next_flush"][candidate_id] = 2 * n
        _flush()


# ----------------------------------------------------------------------------- adapters


def _build(candidate: dict, cls, layer, **kwargs):
    """Construct the candidate with ``kwargs`` and tie its parameters to ``layer``'s of
    the same name (vLLM loads weights into the layer; the candidate sees them).
    Raises ``TypeError`` when a candidate parameter has no same-shaped layer parameter."""
    from torch import nn

    cid = candidate["id"]
    try:
        module = cls(**kwargs)
        layer_params = dict(layer.named_parameters(recurse=False))
        for name, param in list(module.named_parameters()):
            mine = layer_params.get(name)
            if mine is None or tuple(mine.shape) != tuple(param.shape):
                raise TypeError(
                    f"parameter {name} {tuple(param.shape)} has no same-shaped parameter in vLLM's "
                    f"{type(layer).__mro__[1].__name__} (has {sorted(layer_params)})"
                )
            owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
            leaf = name.rpartition(".")[2]
            assert isinstance(mine, nn.Parameter)
            owner._parameters[leaf] = mine
    except Exception as exc:
        _record_error(cid, "constructor", exc)
        raise
    _STATE["constructed"][cid] = _STATE["constructed"].get(cid, 0) + 1
    _flush()
    return module


def _call(candidate_id: str, module, *args):
    _count(candidate_id)
    try:
        return module(*args)
    except Exception as exc:
        _record_error(candidate_id, "forward", exc)
        raise


def _load(candidate: dict):
    from kb_nano.candidates import load_class

    target = candidate["id"].split("/", 1)[0]
    try:
        return load_class(Path(candidate["path"]), target)
    except Exception as exc:
        _record_error(candidate["id"], "import", exc)
        raise


def _rms_norm_adapter(plain: dict | None, fused: dict | None):
    from vllm.model_executor.layers.layernorm import RMSNorm

    plain_cls = _load(plain) if plain else None
    fused_cls = _load(fused) if fused else None

    class KbNanoRMSNorm(RMSNorm):
        """vLLM ``RMSNorm`` whose forward runs the kb-nano ``rms_norm`` candidate
        (``residual is None``) or ``fused_add_rms_norm`` candidate (with ``residual``)."""

        def __init__(self, hidden_size, eps=1e-6, var_hidden_size=None, has_weight=True, dtype=None):
            super().__init__(hidden_size, eps, var_hidden_size, has_weight, dtype)
            clean = has_weight and self.variance_size_override is None
            args = {"hidden_size": hidden_size, "eps": eps}
            self.kb_rms_norm = _build(plain, plain_cls, self, **args) if clean and plain_cls else None
            self.kb_fused_add_rms_norm = _build(fused, fused_cls, self, **args) if clean and fused_cls else None

        def forward(self, x, residual=None):
            if residual is None:
                if self.kb_rms_norm is None:
                    return super().forward(x)
                return _call(plain["id"], self.kb_rms_norm, x)
            if self.kb_fused_add_rms_norm is None:
                return super().forward(x, residual)
            return _call(fused["id"], self.kb_fused_add_rms_norm, x, residual)

    return {"RMSNorm": KbNanoRMSNorm}


def _activation_adapter(candidate: dict, vllm_name: str):
    from vllm.model_executor.layers import activation

    base = getattr(activation, vllm_name)
    cls = _load(candidate)

    if vllm_name == "SiluAndMul":

        class KbNanoSiluAndMul(base):
            """vLLM ``SiluAndMul`` whose forward runs the kb-nano ``silu_and_mul`` candidate."""

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.kb_candidate = _build(candidate, cls, self)

            def forward(self, x):
                return _call(candidate["id"], self.kb_candidate, x)

        return {vllm_name: KbNanoSiluAndMul}

    class KbNanoGeluAndMul(base):
        """vLLM ``GeluAndMul`` whose forward runs the kb-nano ``gelu_and_mul`` candidate."""

        def __init__(self, approximate: str = "none"):
            super().__init__(approximate)
            self.kb_candidate = _build(candidate, cls, self, approximate=approximate)

        def forward(self, x):
            return _call(candidate["id"], self.kb_candidate, x)

    return {vllm_name: KbNanoGeluAndMul}


def _rotary_adapters(candidate: dict):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

    cls = _load(candidate)

    def _forward(self, positions, query, key=None):
        return _call(candidate["id"], self.kb_candidate, positions, query, key)

    class KbNanoRotaryEmbedding(RotaryEmbedding):
        """vLLM ``RotaryEmbedding`` whose forward runs the kb-nano ``rotary_embedding`` candidate."""

        def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype, init_cache=True):
            super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype, init_cache)
            self.kb_candidate = _build(
                candidate,
                cls,
                self,
                head_size=head_size,
                rotary_dim=rotary_dim,
                max_position_embeddings=max_position_embeddings,
                base=base,
                is_neox_style=is_neox_style,
                dtype=dtype,
            )

        forward = _forward

    class KbNanoLlama3RotaryEmbedding(Llama3RotaryEmbedding):
        """vLLM ``Llama3RotaryEmbedding``; the scaling arguments become the baseline's
        ``rope_scaling = {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
        original_max_position_embeddings}``."""

        def __init__(
            self,
            head_size,
            rotary_dim,
            max_position_embeddings,
            base,
            is_neox_style,
            dtype,
            scaling_factor,
            low_freq_factor,
            high_freq_factor,
            orig_max_position,
        ):
            super().__init__(
                head_size,
                rotary_dim,
                max_position_embeddings,
                base,
                is_neox_style,
                dtype,
                scaling_factor,
                low_freq_factor,
                high_freq_factor,
                orig_max_position,
            )
            scaling = {
                "rope_type": "llama3",
                "factor": scaling_factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": orig_max_position,
            }
            self.kb_candidate = _build(
                candidate,
                cls,
                self,
                head_size=head_size,
                rotary_dim=rotary_dim,
                max_position_embeddings=max_position_embeddings,
                base=base,
                is_neox_style=is_neox_style,
                dtype=dtype,
                rope_scaling=scaling,
            )

        forward = _forward

    return {"RotaryEmbedding": KbNanoRotaryEmbedding, "Llama3RotaryEmbedding": KbNanoLlama3RotaryEmbedding}


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Registers one out-of-tree adapter per
    vLLM class that an active candidate maps to; a no-op without active candidates and
    on a second call in the same process. Raises (and records) when a candidate file
    does not import, so the engine fails to start with that reason."""
    if _STATE["registered"]:
        return
    _STATE["registered"] = True
    try:
        active = active_from_env()
    except Exception as exc:
        _record_error("(plugin)", "import", exc)
        raise
    if not active:
        return
    from vllm.model_executor.custom_op import CustomOp

    by_target = {c["id"].split("/", 1)[0]: c for c in active}
    adapters: dict = {}
    if "rms_norm" in by_target or "fused_add_rms_norm" in by_target:
        adapters.update(_rms_norm_adapter(by_target.get("rms_norm"), by_target.get("fused_add_rms_norm")))
    if "silu_and_mul" in by_target:
        adapters.update(_activation_adapter(by_target["silu_and_mul"], "SiluAndMul"))
    if "gelu_and_mul" in by_target:
        adapters.update(_activation_adapter(by_target["gelu_and_mul"], "GeluAndMul"))
    if "rotary_embedding" in by_target:
        adapters.update(_rotary_adapters(by_target["rotary_embedding"]))
    for vllm_name, cls in adapters.items():
        CustomOp.register_oot(cls, name=vllm_name)
    atexit.register(_flush)
    _flush()
