"""Graph time vs K (input sets and graph size), in one process: kb-nano-style K-call graph vs do_bench_cudagraph."""

import argparse
import collections
import sys

sys.path.insert(0, "bench")
import fidelity as F
import torch
import triton.testing

from kb_nano.kernels import timing

dev = torch.device("cuda")
a = argparse.Namespace(
    model="llama31-8b",
    num_tokens=[1],
    context_lens=[1024],
    targets=["rms_norm", "silu_and_mul", "attention"],
    max_decode_tokens=0,
    max_prefill_tokens=16,
)
want = {"rms_norm/torch_fused", "silu_and_mul/inplace", "attention/gqa_grouped"}
rows = [(s, c) for s, c in F.rows_of(a) if c in want and not s.get("context_len")]


def kb_graph(m, sets, replays):
    g, outs = timing.capture_graph(lambda i: m(*sets[i]), range(len(sets)), dev)
    res = []
    for _ in range(9):
        res.append(timing.time_graph(g, dev, None, replays) / replays / len(sets))
    del g, outs
    return sorted(res)[4]


def dbcg(m, sets, nrep=None):
    i, held = [0], collections.deque(maxlen=len(sets))

    def fn():
        held.append(m(*sets[i[0] % len(sets)]))
        i[0] += 1

    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


print("row | K | kb-style graph (K nodes) | dbcg ring K | kb-style graph 4x nodes (same K sets)")
with torch.inference_mode():
    for s, c in rows:
        m = F.modules(s, c, dev)["baseline"]
        for k in (16, 64, 257, 1000):
            sets = F.input_sets(s, dev, k)
            a1 = kb_graph(m, sets, max(1, 2000 // k))
            a2 = dbcg(m, sets)
            a3 = kb_graph(m, sets * 4, max(1, 500 // k))
            print(
                f"{s['scenario_id']} {c} baseline | {k} | {a1 * 1e3:.2f}us | {a2 * 1e3:.2f}us | {a3 * 1e3:.2f}us",
                flush=True,
            )
            del sets
            torch.cuda.empty_cache()
