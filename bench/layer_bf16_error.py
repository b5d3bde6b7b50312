"""How far the transformers decoder layer in bf16 is from the same layer in float64.

Sets the scale of the L3/L4 tolerance (kb_nano.operators.base TOLERANCES["layer"]):
    python bench/layer_bf16_error.py --model llama31-8b --tp 4 --num-tokens 64
Prints max |bf16 - fp64| and max |fp64| of the layer output (hidden_states), same seeded
weights and inputs. CPU is fine (a few GiB of memory for an 8B layer).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kb_nano import operators
from kb_nano.kernels.manifest import generate
from kb_nano.operators.base import make_tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama31-8b")
    parser.add_argument("--num-tokens", type=int, default=64)
    parser.add_argument("--tp", type=int, default=4)
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    manifest = generate([args.model], [args.tp], [args.num_tokens], "auto", root)
    (scenario,) = [s for s in manifest["scenarios"] if s["target"] == "decoder_layer"]
    op = operators.get("decoder_layer")
    torch.manual_seed(0)
    layer = op.baseline(**scenario["init_args"]).eval()
    gen = torch.Generator().manual_seed(0)
    inputs = [make_tensor(spec, gen, "cpu") for spec in scenario["inputs"]]
    with torch.inference_mode():
        ref = layer.to(torch.float64)(*[t.to(torch.float64) if t.is_floating_point() else t for t in inputs])
        out = layer.to(torch.bfloat16)(*[t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs])
    err = (out.double() - ref).abs().max().item()
    print(f"{scenario['scenario_id']}: max|bf16 - fp64| = {err:.4f}, max|fp64| = {ref.abs().max().item():.3f}")


if __name__ == "__main__":
    main()
