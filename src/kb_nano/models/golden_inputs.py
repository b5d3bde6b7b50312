"""Scenario inputs from golden tensors (:mod:`kb_nano.models.golden`): the kernel job's
judge builds the inputs of an ``attention``, ``fused_moe`` or ``sampler`` scenario from the
captured files (:func:`golden_inputs`, called by :func:`kb_nano.kernels.inputs.make_inputs`);
when the capture cannot provide them it raises :class:`GoldenMismatch` and the scenario
falls back to seeded random inputs.
"""

from __future__ import annotations

from pathlib import Path

from kb_nano.errors import KbNanoError
from kb_nano.models.golden import read_sidecar


class GoldenMismatch(Exception):
    """The golden tensors cannot provide a scenario's inputs (too few tokens, other head
    layout); the scenario falls back to seeded random inputs. The message says why."""


def golden_inputs(scenario: dict, golden: dict, root: Path, device: str, draw: int):
    """The inputs of ``scenario`` built from golden tensors, as a ``{name: tensor}`` dict of
    the names golden data provides (the other inputs, e.g. the sampler's noise, stay
    seeded random).

    Args:
        scenario: manifest entry (``target``, ``init_args``, ``inputs`` specs, ``variant``).
        golden: ``{"path": sidecar path, "sha256": ...}`` (the kernel job's param).
        draw: 0 for the first input set, 1 for the second correctness check: a different
            captured layer and prompt, so a candidate that caches its first answer fails.
    Shapes follow the scenario's specs; TP scenarios take rank 0's heads (query heads
    ``0..h/tp-1`` and KV heads ``0..kv/tp-1``, which GQA groups together). Rows beyond the
    captured ones (decode sequences > prompts, MoE tokens > P*L, sampler rows) cycle.
    Raises ``GoldenMismatch`` when the capture cannot provide the scenario (too few tokens,
    other head_dim, multi-head latent attention) and ``KbNanoError`` when the golden file
    is unreadable.
    """
    import torch
    from safetensors import safe_open

    from kb_nano.operators.base import DTYPES

    sidecar_file = Path(golden["path"])
    sidecar_file = sidecar_file if sidecar_file.is_absolute() else root / sidecar_file
    meta = read_sidecar(sidecar_file)
    if meta is None:
        raise KbNanoError(f"{sidecar_file}: golden sidecar or its safetensors file is missing; rerun capture-golden")
    specs = {s["name"]: s for s in scenario["inputs"]}
    target = scenario["target"]
    try:
        f = safe_open(str(sidecar_file.parent / meta["file"]), framework="pt", device="cpu")
    except Exception as exc:
        raise KbNanoError(
            f"{sidecar_file.parent / meta['file']}: unreadable golden tensors ({exc}); rerun capture-golden"
        ) from None
    layers = meta.get("layers") or [0]
    layer = layers[draw % len(layers)]

    def cast(name, t):
        return t.to(device=device, dtype=DTYPES[specs[name]["dtype"]]).reshape(specs[name]["shape"]).contiguous()

    if target == "attention":
        args = scenario["init_args"]
        if args.get("kv_lora_rank"):
            raise GoldenMismatch("golden attention holds no multi-head latent attention inputs (MLA latents)")
        h, kv, d = args["num_heads"], args["num_kv_heads"], args["head_size"]
        q, k, v = (f.get_tensor(f"layer{layer}.{n}") for n in ("query", "key", "value"))
        prompts, seq_len = q.shape[0], q.shape[1]
        if q.shape[3] != d or q.shape[2] < h or k.shape[2] < kv:
            raise GoldenMismatch(f"golden attention has {q.shape[2]} heads x {q.shape[3]}, scenario {h} x {d}")
        q, k, v = q[:, :, :h], k[:, :, :kv], v[:, :, :kv]
        n = specs["query"]["shape"][0]
        if "key_cache" not in specs:  # prefill: the first n tokens of one prompt
            if n > seq_len:
                raise GoldenMismatch(f"prefill of {n} tokens > {seq_len} captured tokens per prompt")
            p = draw % prompts
            parts = {"query": q[p, :n], "key": k[p, :n], "value": v[p, :n]}
        else:  # decode: sequence j = prompt (draw + j) % P at position C, cache = positions < C
            c = specs["key_cache"]["shape"][1]
            if c + 1 > seq_len:
                raise GoldenMismatch(f"decode context {c} + 1 > {seq_len} captured tokens per prompt")
            idx = torch.tensor([(draw + j) % prompts for j in range(n)])
            parts = {
                "query": q[idx, c],
                "key": k[idx, c],
                "value": v[idx, c],
                "key_cache": k[idx, :c],
                "value_cache": v[idx, :c],
            }
        return {name: cast(name, t) for name, t in parts.items()}
    if target == "fused_moe":
        x, logits = f.get_tensor(f"layer{layer}.hidden_states"), f.get_tensor(f"layer{layer}.router_logits")
        n, hidden = specs["hidden_states"]["shape"]
        if x.shape[1] != hidden or logits.shape[1] != specs["router_logits"]["shape"][1]:
            raise GoldenMismatch(
                f"golden fused_moe is [{x.shape[1]} hidden, {logits.shape[1]} experts], scenario [{hidden}, {specs['router_logits']['shape'][1]}]"
            )
        rows = (torch.arange(n) + draw * 997) % x.shape[0]
        return {"hidden_states": cast("hidden_states", x[rows]), "router_logits": cast("router_logits", logits[rows])}
    if target == "sampler":
        logits = f.get_tensor("logits")
        n, vocab = specs["logits"]["shape"]
        if logits.shape[1] != vocab:
            raise GoldenMismatch(f"golden logits have vocab {logits.shape[1]}, scenario {vocab}")
        rows = (torch.arange(n) + draw * (logits.shape[0] // 2)) % logits.shape[0]
        return {"logits": cast("logits", logits[rows])}
    raise GoldenMismatch(f"no golden inputs for operator {target}")
