"""Golden tensors: real inputs of the data-dependent operators, captured from a model run.

Random inputs are fine for a norm, but not for operators whose cost or numerics depend on
the data: which experts a token is routed to (``fused_moe``), how peaked the attention
scores are over a real sequence (``attention``), how the logits of a real vocabulary are
distributed (``sampler``). :func:`capture` runs the model of a vendored ``config.json`` on
the shipped prompt set (``config/golden/prompts.yaml``) and saves those operators' inputs;
:func:`kb_nano.models.golden_inputs.golden_inputs` turns them into the inputs of a kernel
scenario.

The model: local weights when a directory is given (``from_pretrained``), otherwise
transformers' own random initialisation of the architecture (``from_config``; seeded,
``normal(0, initializer_range)``), with the decoder truncated to ``num_layers`` layers
(recorded). Prompts: each of the ``P`` prompts truncated to :data:`SEQ_LEN` tokens; with
weights that ship a tokenizer it is used, otherwise the token ids are the prompt's UTF-8
bytes (ids 0-255: the byte tokens of byte-level BPE vocabularies such as Llama-3's and
Qwen's; recorded as ``tokenization: utf8-bytes``). One forward pass over the batch
``[P, SEQ_LEN]`` with positions ``0..SEQ_LEN-1`` and the causal mask:

- ``attention``: per layer, the ``query`` ``[P, L, heads, head_dim]``, ``key`` and
  ``value`` ``[P, L, kv_heads, head_dim]`` handed to the attention function, i.e. after
  the projections, Qwen3's q/k norm and RoPE (captured through transformers'
  ``AttentionInterface``, the library's hook for attention implementations). Causal
  attention makes token ``t`` of a prefill identical to a decode step at position ``t``
  against a KV cache holding tokens ``0..t-1``, so the same tensors give prefill inputs
  (first ``N`` tokens of one prompt) and decode inputs (key/value cache = the first ``C``
  keys/values, new token = position ``C``).
- ``fused_moe``: per MoE layer, the MoE block's ``hidden_states`` ``[P*L, hidden]`` and the
  ``router_logits`` ``[P*L, experts]`` that ``fused_moe`` takes, both in a forward pre-hook
  on the block (a layer's ``mlp`` / ``feed_forward`` / ``block_sparse_moe`` with
  ``experts``): the logits are ``F.linear(hidden_states, router.weight, router.bias)`` of
  its router child (``gate``: Mixtral, Qwen3-MoE, DeepSeek-V3; ``router``: gpt-oss,
  Llama-4; :func:`kb_nano.models.ffn_tree.moe_router`), in the model dtype, not the
  router's return value, which differs per class (gpt-oss's and Llama-4's routers return
  scores too, Llama-4's scores first).
- ``sampler``: ``logits`` ``[P * SAMPLER_ROWS_PER_PROMPT, vocab]`` float32 of the last
  positions of every prompt (``logits_to_keep``), as vLLM's sampler receives them.

Files (``results/golden/{model}/``): ``{operator}.safetensors`` and a JSON sidecar
``{operator}.json`` (model, hub id, config digest, weights, layers, prompt digest,
tokenization, dtype, tensor shapes, the safetensors file's sha256, versions). Deterministic:
fixed seed, fixed prompts, fixed thread count; no timestamps, so the same command gives
identical files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kb_nano.errors import KbNanoError

GOLDEN_TARGETS = ("attention", "fused_moe", "sampler")
GOLDEN_DIR = Path("results/golden")
PROMPTS_FILE = Path("config/golden/prompts.yaml")
# Tokens per prompt: covers the prefill token counts and decode context lengths (C + 1 <= L)
# of the embedded default (num_tokens <= 64, context_lens 256). Larger scenarios use random
# inputs (the job log says why).
SEQ_LEN = 512
# Logit rows per prompt kept for the sampler (its last positions).
SAMPLER_ROWS_PER_PROMPT = 16
DEFAULT_NUM_LAYERS = 2
SEED = 0
CAPTURE_ATTENTION = "kb_nano_capture"


def sidecar_path(root: Path, model: str, target: str) -> Path:
    """``results/golden/{model}/{target}.json`` under ``root``."""
    return root / GOLDEN_DIR / model / f"{target}.json"


def read_sidecar(path: Path) -> dict | None:
    """The sidecar at ``path`` when it and its safetensors file exist, else None."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not (path.parent / meta.get("file", "")).is_file():
        return None
    return meta


def load_prompts(root: Path) -> tuple[list[str], str]:
    """The shipped prompts and the sha256 of the prompts file. Raises ``KbNanoError`` when
    the file is missing, malformed, or a prompt is shorter than :data:`SEQ_LEN` bytes."""
    import yaml

    path = root / PROMPTS_FILE
    try:
        raw = path.read_bytes()
        prompts = yaml.safe_load(raw)["prompts"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise KbNanoError(f"{path}: cannot read the prompt set ({type(exc).__name__}); restore it from git") from None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise KbNanoError(f"{path}: 'prompts' must be a non-empty list of strings")
    for i, p in enumerate(prompts):
        if len(p.encode()) < SEQ_LEN:
            raise KbNanoError(f"{path}: prompt {i} has {len(p.encode())} UTF-8 bytes; each needs at least {SEQ_LEN}")
    return prompts, hashlib.sha256(raw).hexdigest()


def tokenize(prompts: list[str], vocab_size: int, weights: Path | None):
    """Token ids ``[P, SEQ_LEN]`` int64 and the tokenization used: the tokenizer shipped with
    ``weights`` when there is one (``tokenizer:<dir>``), else UTF-8 bytes (``utf8-bytes``).
    Raises ``KbNanoError`` when a prompt is too short for the tokenizer or ids exceed the vocab."""
    import torch

    if weights is not None and any(
        (weights / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    ):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(weights))
        rows = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        how = f"tokenizer:{weights}"
    else:
        rows = [list(p.encode()) for p in prompts]
        how = "utf8-bytes"
    short = [i for i, r in enumerate(rows) if len(r) < SEQ_LEN]
    if short:
        raise KbNanoError(f"{PROMPTS_FILE}: prompt(s) {short} give fewer than {SEQ_LEN} tokens with {how}")
    ids = torch.tensor([r[:SEQ_LEN] for r in rows], dtype=torch.int64)
    if int(ids.max()) >= vocab_size:
        raise KbNanoError(f"{how}: token id {int(ids.max())} >= vocab_size {vocab_size}")
    return ids, how


def build_model(config: dict, num_layers: int, weights: Path | None, dtype):
    """The causal LM of ``config`` (config.json fields) truncated to ``num_layers`` decoder
    layers, in ``dtype``, with the capturing attention function (registered by
    :func:`capture`): the weights of ``weights`` (a local directory) or transformers' random
    initialisation seeded with :data:`SEED`, so two builds are identical. Raises
    ``KbNanoError`` when the weights do not load."""
    import torch
    from transformers import AutoModelForCausalLM

    from kb_nano.operators.hf_modules import hf_config

    cfg = hf_config(config, num_hidden_layers=num_layers, attn_implementation=CAPTURE_ATTENTION)
    cfg.dtype = dtype
    if weights is not None:
        try:
            return AutoModelForCausalLM.from_pretrained(
                str(weights), config=cfg, dtype=dtype, attn_implementation=CAPTURE_ATTENTION
            )
        except Exception as exc:  # OSError, ValueError, SafetensorError, ...: a bad weights directory
            raise KbNanoError(
                f"--weights {weights}: cannot load the weights ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:200]})"
            ) from None
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=CAPTURE_ATTENTION)


def capture(
    config: dict,
    meta: dict,
    root: Path,
    out_dir: Path,
    num_layers: int = DEFAULT_NUM_LAYERS,
    weights: Path | None = None,
    num_threads: int = 1,
) -> list[Path]:
    """Run the model and write the golden files of every data-dependent operator it has.

    Args:
        config: the model's config.json fields.
        meta: recorded in every sidecar: ``model`` (key), ``hub_id``, ``config_sha256``.
        root: workflow root (for the prompt set).
        out_dir: directory to write ``{operator}.safetensors`` + ``{operator}.json`` into.
        num_layers: decoder layers kept (``0`` = all of the config).
        weights: directory of local weights (safetensors + config) or None for random ones.
        num_threads: torch CPU threads (fixed so reruns are bit-identical).
    Returns the written sidecar paths. Raises ``KbNanoError`` for bad prompts or weights.
    """
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kb_nano.models.ffn_tree import FFN_NAMES, moe_router
    from kb_nano.operators.base import DTYPES
    from kb_nano.operators.moe import is_moe

    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)
    from kb_nano.operators.hf_modules import hf_config

    full = hf_config(config)  # the config object: attribute_map names resolved (GPT-2's n_layer)
    total_layers = int(full.num_hidden_layers)
    layers = total_layers if num_layers in (0, None) else min(int(num_layers), total_layers)
    dtype_name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    dtype = DTYPES.get(dtype_name, torch.bfloat16)
    prompts, prompts_sha = load_prompts(root)
    ids, tokenization = tokenize(prompts, int(full.vocab_size), weights)

    captured: dict[str, dict[str, torch.Tensor]] = {t: {} for t in GOLDEN_TARGETS}

    def capture_attention(module, query, key, value, attention_mask, **kwargs):
        # query [P, heads, L, d], key/value [P, kv_heads, L, d] (after q/k norm and RoPE)
        i = module.layer_idx
        for name, t in (("query", query), ("key", key), ("value", value)):
            captured["attention"][f"layer{i}.{name}"] = t.transpose(1, 2).contiguous().clone()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CAPTURE_ATTENTION, capture_attention)
    model = build_model(config, layers, weights, dtype).eval()
    hooks = []
    for i, layer in enumerate(model.model.layers):
        block = next((getattr(layer, n) for n in FFN_NAMES if hasattr(layer, n)), None)
        router = moe_router(block) if block is not None else None
        if router is not None:

            def pre(mod, args, i=i, router=router):
                # the block's input, flattened to tokens, and its router's logits computed
                # from it as fused_moe takes them (the routers' own outputs differ per class)
                x = args[0].reshape(-1, router.weight.shape[-1])
                moe = captured["fused_moe"]
                moe[f"layer{i}.hidden_states"] = x.clone()
                moe[f"layer{i}.router_logits"] = F.linear(x, router.weight, getattr(router, "bias", None)).clone()

            hooks.append(block.register_forward_pre_hook(pre))
    with torch.inference_mode():
        out = model(input_ids=ids, logits_to_keep=SAMPLER_ROWS_PER_PROMPT, use_cache=False)
    for h in hooks:
        h.remove()
    captured["sampler"]["logits"] = out.logits.float().reshape(-1, out.logits.shape[-1]).contiguous()
    if not is_moe({"hf_config": config, "model_type": config.get("model_type")}):
        captured["fused_moe"] = {}

    import safetensors
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for target, tensors in captured.items():
        if not tensors:
            continue
        file = out_dir / f"{target}.safetensors"
        # One metadata key: safetensors writes a metadata map in hash order, which would make
        # two captures of the same tensors differ byte-wise.
        save_file(tensors, str(file), metadata={"kb_nano_sidecar": f"{target}.json"})
        _chmod_like_umask(file)  # safetensors writes 0600; readers on a shared file system need the umask's bits
        sidecar = {
            "operator": target,
            **meta,
            "architecture": (config.get("architectures") or [None])[0],
            "weights": str(weights)
            if weights
            else f"random: transformers _init_weights of the config, torch seed {SEED}",
            "num_hidden_layers": {"captured": layers, "model": total_layers},
            # the layers this file holds (fused_moe: the MoE layers only; DeepSeek-V3's first are dense)
            "layers": sorted({int(k.split(".")[0].removeprefix("layer")) for k in tensors})
            if target != "sampler"
            else None,
            "prompts": {
                "file": str(PROMPTS_FILE),
                "sha256": prompts_sha,
                "count": len(prompts),
                "seq_len": SEQ_LEN,
                "tokenization": tokenization,
            },
            "positions": f"0..{SEQ_LEN - 1} per prompt; causal mask",
            "dtype": dtype_name,
            "tensors": {
                k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                for k, v in sorted(tensors.items())
            },
            "file": file.name,
            "sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
            "num_threads": num_threads,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "safetensors_version": safetensors.__version__,
        }
        path = out_dir / f"{target}.json"
        path.write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


def _chmod_like_umask(path: Path) -> None:
    import os

    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
