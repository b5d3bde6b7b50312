"""The values a measurement feeds both sides, made by the judge.

Seeds: every measurement draws its seed from the operating system
(:func:`draw_seed`; the row records it, ``--seed`` replays it). The input values come
from that seed and never leave the judge; the module parameters come from
:func:`param_seed`, a one-way hash of it, because both workers build them (so a
candidate that learns its parameter seed still cannot compute the inputs).

Distributions: each input spec names its distribution (``normal`` N(0, std^2) for
activations and hidden states, ``randint`` for token ids and positions, ``uniform``,
``exponential``; :func:`kb_nano.operators.base.make_tensor`). Correctness trials draw fresh
values and add the operator's edge cases (:data:`EDGE_CASES`, chosen per operator in
``Operator.edge_cases``). Timed calls get new values in every slot before every batch
(:class:`Refresher`: random windows of a per-measurement pool, scaled; golden inputs
rotate and are scaled), so no two calls see the same values.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

import torch

from kb_nano.operators.base import DTYPES, make_tensor, refill_

# name -> what it does to the N(0, std^2) inputs of a correctness trial
EDGE_CASES = {
    "zero_row": "token row 0 of every normally distributed input set to zeros",
    "tiny": "normally distributed inputs scaled by 1e-3 (variance near a norm's eps)",
    "large": "normally distributed inputs scaled by 100",
}
_SCALE = {"tiny": 1e-3, "large": 100.0}


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (62-bit seeds are folded to 63 bits)."""
    return torch.Generator(device=device).manual_seed(seed & 0x7FFFFFFFFFFFFFFF)


def draw_seed() -> int:
    """A fresh 62-bit seed from the OS's random source (``secrets``)."""
    return secrets.randbits(62)


def param_seed(seed: int) -> int:
    """The 31-bit seed of the module parameters of measurement ``seed``:
    ``sha256(f"params:{seed}")``, so it does not reveal ``seed``."""
    return int(hashlib.sha256(f"params:{seed}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def randomize_constant_parameters(module: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Add seeded N(0, std^2) noise to every floating-point parameter whose elements are all
    equal (RMSNorm's ones, a zero bias), in place.

    Weights initialised to a constant cannot tell a candidate that ignores them from a
    correct one (``x * 1 == x``); vLLM's kernel tests randomise them the same way
    (``weight.normal_(mean=1.0, std=0.1)``). Randomly initialised parameters are kept.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            flat = p.detach().flatten()
            # the first elements decide for almost every random weight (a cheap look first)
            if (
                p.is_floating_point()
                and p.numel() > 0
                and bool((flat[:64] == flat[0]).all())
                and bool((flat == flat[0]).all())
            ):
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float32) * std
                p.add_(noise.to(device=p.device, dtype=p.dtype))


def make_inputs(scenario: dict, generator: torch.Generator, device: str, golden: dict | None, root: Path, draw: int):
    """The input tensors of one call of ``scenario`` (in spec order) and their source.

    With ``golden`` (the job's ``{"path", "sha256"}`` param, see
    :func:`kb_nano.workflow.golden_param`) the inputs the capture provides come from it
    (:func:`kb_nano.models.golden_inputs.golden_inputs`; ``draw`` 0 or 1 picks another layer/prompt) and
    the rest are seeded random: source ``"golden"``. Without it, or when the capture does
    not cover the scenario (the reason is printed to the job log), all inputs are seeded
    random from ``generator``: source ``"random"``. Random values are drawn on
    ``generator``'s device (a CUDA generator draws on the GPU: a CPU draw of a
    16384-token input takes seconds).
    """
    provided: dict = {}
    if golden:
        from kb_nano.models.golden_inputs import GoldenMismatch, golden_inputs

        try:
            provided = golden_inputs(scenario, golden, root, device, draw)
        except GoldenMismatch as exc:
            print(f"golden inputs not used for {scenario['scenario_id']}: {exc}; using seeded random inputs")
    tensors = [
        provided[s["name"]] if s["name"] in provided else draw_tensor(s, generator, device) for s in scenario["inputs"]
    ]
    return tensors, "golden" if provided else "random"


def draw_tensor(spec: dict, generator: torch.Generator, device: str) -> torch.Tensor:
    """A tensor of ``spec`` drawn with ``generator`` on its own device (then moved to
    ``device``); a CPU generator gives the same values as
    :func:`kb_nano.operators.base.make_tensor`."""
    if generator.device.type == "cpu":
        return make_tensor(spec, generator, device)
    t = torch.empty(spec["shape"], dtype=DTYPES[spec["dtype"]], device=generator.device)
    return refill_(t, spec, generator).to(device)


def apply_edge_case(tensors: list[torch.Tensor], specs: list[dict], case: str) -> None:
    """Turn one trial's inputs into edge case ``case`` (:data:`EDGE_CASES`), in place.
    Raises ``KeyError`` for an unknown case."""
    if case not in EDGE_CASES:
        raise KeyError(f"unknown edge case {case!r}; known: {', '.join(EDGE_CASES)}")
    for t, spec in zip(tensors, specs):
        if spec["init"]["dist"] != "normal" or not t.is_floating_point() or t.numel() == 0:
            continue
        if case == "zero_row":
            t[0].zero_()
        else:
            t.mul_(_SCALE[case])


# The factor a timed slot's values are multiplied by, drawn per slot and input: values no
# window of the pool repeats, never larger than the distribution the tolerances were
# calibrated on (TOLERANCES in kb_nano.operators.base). Up to 1.25 (before), q and k of an
# attention decode over 256 keys at x1.25 made the bf16 baseline's own error reach 101% of
# the attention class (logits 1.56x larger) and honest SDPA fail at 131%.
FACTOR_RANGE = (0.75, 1.0)
# Elements a pool holds beyond one slot: every window start is one of this many, so a
# candidate that learns the pool from the windows it sees and precomputes its work per
# window start (a breaker's did for mlp at 1 token, where a pool of the slot + 4096 had
# 4097 starts: a cached gate_up GEMM, 2.52x) would have to see about this many values and
# precompute a call per start; calls that repeat a start are rare (k calls: about
# k^2 / 2^21 repeats). Drawing it costs about 5 ms per input on a CPU core.
POOL_EXTRA = 1 << 20


class Refresher:
    """Writes fresh values into the judge's input slots before every batch.

    ``slots``: one ``[k, *shape]`` tensor per input spec (slot ``i`` is row ``i``).
    Random inputs: each spec gets a pool of at least twice a slot's elements, and at least
    :data:`POOL_EXTRA` more than a slot's, drawn from
    its distribution with a generator seeded from the measurement seed; every slot of
    every batch is a window of that pool starting at a random element offset, and for
    N(0, std^2) inputs also multiplied by a random factor in :data:`FACTOR_RANGE`; inputs with
    ``row_mean_std`` then get per-row offsets, windows of a pool of N(0, row_mean_std^2). So no call
    sees values another call saw, nothing can be predicted without the seed, and a
    refill costs one pass over the slot instead of a random draw per element (which
    costs several times the kernels it feeds). Golden inputs: up to 8 captured draws
    rotate, each slot scaled by a fresh factor in :data:`FACTOR_RANGE` (router logits keep their
    top-k, attention its structure)."""

    def __init__(
        self, scenario: dict, slots: list[torch.Tensor], seed: int, golden: dict | None, root: Path, first_draw: int
    ) -> None:
        self.specs = scenario["inputs"]
        self.slots = slots
        device = slots[0].device if slots else torch.device("cpu")
        self.rng = torch.Generator().manual_seed((seed ^ 0x5EED) + first_draw)  # offsets and factors (CPU)
        self.sets = self.pools = None
        if golden:
            self.sets = [
                make_inputs(scenario, generator(device, seed + d), str(device), golden, root, draw=first_draw + d)[0]
                for d in range(8)
            ]
        else:
            gen = torch.Generator(device=device).manual_seed((seed ^ 0x9001) + first_draw)
            self.pools, self.offsets = [], []
            for t, spec in zip(slots, self.specs):
                n = t[0].numel() if len(t) else 0
                init = spec["init"]
                flat = {**spec, "init": {k: v for k, v in init.items() if k != "row_mean_std"}}
                pool = torch.empty(max(2 * n, n + POOL_EXTRA) if n else 0, dtype=t.dtype, device=device)
                self.pools.append(refill_(pool, flat, gen))
                offsets = None
                if init.get("row_mean_std"):  # per-row offsets: a pool of their own, windowed the same way
                    rows = n // t.shape[-1] if n else 0
                    offsets = torch.empty(max(2 * rows, rows + 4096), dtype=t.dtype, device=device)
                    offsets.normal_(0.0, float(init["row_mean_std"]), generator=gen)
                self.offsets.append(offsets)
        self.calls = 0

    def _factor(self) -> float:
        low, high = FACTOR_RANGE
        return low + (high - low) * float(torch.rand((), generator=self.rng))

    def __call__(self, n: int) -> None:
        """New values in slots ``0 .. n-1``."""
        for k in range(n):
            if self.pools is not None:
                for t, spec, pool, offsets in zip(self.slots, self.specs, self.pools, self.offsets):
                    size = t[k].numel()
                    off = int(torch.randint(0, pool.numel() - size + 1, (), generator=self.rng))
                    window = pool[off : off + size].view(t[k].shape)
                    if spec["init"]["dist"] == "normal":
                        torch.mul(window, self._factor(), out=t[k])
                    else:
                        t[k].copy_(window)
                    if offsets is not None:
                        rows = size // t.shape[-1]
                        off = int(torch.randint(0, offsets.numel() - rows + 1, (), generator=self.rng))
                        t[k].add_(offsets[off : off + rows].view(*t[k].shape[:-1], 1))
            else:
                factor = self._factor()
                for t, v in zip(self.slots, self.sets[self.calls % len(self.sets)]):
                    t[k].copy_(v)
                    if t.is_floating_point():
                        t[k].mul_(factor)
            self.calls += 1
