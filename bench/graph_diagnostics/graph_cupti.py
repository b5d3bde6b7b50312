"""Does CUPTI (kb-nano's KernelTimer, as every CUDA worker sets it up) change graph replay time?"""

import argparse
import sys

sys.path.insert(0, "bench")
import fidelity as F
import torch

from kb_nano.kernels import timing

dev = torch.device("cuda")
a = argparse.Namespace(
    model="llama31-8b",
    num_tokens=[1, 16],
    context_lens=[1024],
    targets=["rms_norm", "silu_and_mul", "attention"],
    max_decode_tokens=0,
    max_prefill_tokens=16,
)
want = {"rms_norm/torch_fused", "silu_and_mul/inplace", "attention/gqa_grouped"}
rows = [(s, c) for s, c in F.rows_of(a) if c in want and not s.get("context_len")]


def kb_graph(m, sets):
    g, outs = timing.capture_graph(lambda i: m(*sets[i]), range(len(sets)), dev)
    replays = max(1, int(8.0 / (12e-3 * len(sets))))
    res = sorted(timing.time_graph(g, dev, None, replays) / replays / len(sets) for _ in range(9))
    del g, outs
    return res[4]


def eager_loop(m, sets):  # plain launches, event pair around 200 calls
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(20):
        m(*sets[0])
    s.record()
    for i in range(200):
        m(*sets[i % len(sets)])
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 200


with torch.inference_mode():
    mods, setss = [], []
    for s, c in rows:
        mods.append(F.modules(s, c, dev)["baseline"])
        setss.append(F.input_sets(s, dev, 16))

    def sweep(label):
        print(
            label,
            " | ".join(
                f"{s['scenario_id'].split('__')[0]} n{s['num_tokens']}: graph {kb_graph(m, st) * 1e3:.2f}us eager-loop {eager_loop(m, st) * 1e3:.2f}us"
                for (s, _), m, st in zip(rows, mods, setss)
            ),
            flush=True,
        )

    sweep("no CUPTI        ")
    from kb_nano.kernels.cupti import KernelTimer

    flush = timing.L2Flush(dev)
    kt = KernelTimer(dev, flush)
    print("kernel timer error:", kt.error)
    sweep("CUPTI set up    ")
    m, st = mods[0], setss[0]
    kt.time_calls(lambda i: m(*st[i]), range(len(st)), lambda i, o: None)
    sweep("after a batch   ")
    kt.trace.start()
    sweep("activity ON     ")
    kt.trace.stop()
    sweep("activity OFF    ")
    code = kt.trace.lib.cuptiFinalize()
    print("cuptiFinalize ->", code)
    sweep("after finalize  ")
