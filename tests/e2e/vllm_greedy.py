"""Greedy generation with vLLM on the embedded tiny Llama (random weights, seeded), for
tests: ``python tests/e2e/vllm_greedy.py OUT.json`` writes the generated token ids.

The kb-nano plugin is active when ``KB_NANO_E2E_CANDIDATES`` names candidates (set by the test)."""

import json
import sys
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "config/models/kb-nano/tiny-llama"

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(MODEL), load_format="dummy", max_model_len=256, enforce_eager=True, seed=0)
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 116 + 7 * i))} for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    Path(sys.argv[1]).write_text(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
