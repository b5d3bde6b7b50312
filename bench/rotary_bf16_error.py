"""How far the rotary_embedding baseline (vLLM's forward_native: products rounded to the
model dtype) and the shipped fp32 candidate (`rotary_embedding/rotate_half`) are from an
fp64 evaluation of the same formula; the source of the "rotary" tolerance in
kb_nano.operators.base.TOLERANCES.

    python bench/rotary_bf16_error.py --model llama31-8b --num-tokens 1024 --seeds 5
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    from kb_nano import operators
    from kb_nano.candidates import load_class
    from kb_nano.kernels.manifest import generate
    from kb_nano.operators.base import make_tensor

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama31-8b")
    p.add_argument("--num-tokens", type=int, default=1024)
    p.add_argument("--seeds", type=int, default=5)
    a = p.parse_args()
    scenario = next(
        s
        for s in generate([a.model], [1], [a.num_tokens], "auto", REPO)["scenarios"]
        if s["target"] == "rotary_embedding"
    )
    op = operators.get("rotary_embedding")
    base = op.baseline(**scenario["init_args"]).to(torch.bfloat16)
    cand = load_class(REPO / "candidates/rotary_embedding/rotate_half.py", "rotary_embedding")(**scenario["init_args"])
    cand = cand.to(torch.bfloat16)
    exact = op.baseline(**scenario["init_args"]).double()
    err_b = err_c = diff = 0.0
    for seed in range(a.seeds):
        g = torch.Generator().manual_seed(seed)
        ins = [make_tensor(s, g, "cpu") for s in scenario["inputs"]]
        with torch.inference_mode():
            rb, rc = base(*[t.clone() for t in ins]), cand(*[t.clone() for t in ins])
            re = exact(ins[0], ins[1].double(), ins[2].double())
        for b, c, e in zip(rb, rc, re):
            err_b = max(err_b, float((b.double() - e).abs().max()))
            err_c = max(err_c, float((c.double() - e).abs().max()))
            diff = max(diff, float((b.double() - c.double()).abs().max()))
    print(
        f"{scenario['scenario_id']}, {a.seeds} seeds: max |baseline - fp64| {err_b:.4g}, "
        f"max |rotate_half - fp64| {err_c:.4g}, max |baseline - rotate_half| {diff:.4g}"
    )


if __name__ == "__main__":
    main()
