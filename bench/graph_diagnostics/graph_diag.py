"""Why kb-nano's graph time and do_bench_cudagraph differ on small calls (diagnostic)."""

import argparse
import sys
import time

sys.path.insert(0, "bench")
import fidelity as F
import torch
import triton.testing

dev = torch.device("cuda")
a = argparse.Namespace(
    model="llama31-8b",
    num_tokens=[1, 16, 256, 1024, 4096],
    context_lens=[1024],
    targets=["rms_norm", "silu_and_mul"],
    max_decode_tokens=0,
    max_prefill_tokens=0,
)
rows = [(s, c) for s, c in F.rows_of(a) if c in ("rms_norm/triton_rowwise", "silu_and_mul/inplace")]


def graph_ms(mod, sets, keep, replays):
    def call(i):
        out = mod(*sets[i])
        return out if keep else None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for i in range(len(sets)):
                call(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [call(i) for i in range(len(sets))]
    torch.cuda.synchronize()
    res = []
    for _ in range(7):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(replays):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        res.append(s.elapsed_time(e) / replays / len(sets))
    del g, outs
    return sorted(res)[3]


print("row | side | K | keep K | drop K | keep 4K | drop 4K | dbcg rot(rep100) | dbcg fixed(rep20)")
with torch.inference_mode():
    for s, c in rows:
        mods = F.modules(s, c, dev)
        for side in ("baseline", "candidate"):
            m = mods[side]
            x = F.input_sets(s, dev, 1)[0]
            m(*x)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                m(*x)
            torch.cuda.synchronize()
            eager = (time.perf_counter() - t0) / 20 * 1e3
            k = F.slots(s, eager, dev)
            sets = F.input_sets(s, dev, k)
            reps = max(1, int(20 / max(eager * k, 1e-3)))
            r = [graph_ms(m, sets, True, reps), graph_ms(m, sets, False, reps)]
            k4 = min(4 * k, 4000)
            sets4 = F.input_sets(s, dev, k4)
            try:
                r += [graph_ms(m, sets4, True, max(1, reps // 4)), graph_ms(m, sets4, False, max(1, reps // 4))]
            except torch.OutOfMemoryError:
                r += [float("nan")] * 2
            del sets4
            r.append(F.do_bench_graph_ms(m, sets, ring=False)[0])  # rotating inputs, one output buffer, rep=100
            r.append(float(triton.testing.do_bench_cudagraph(lambda: m(*x), rep=20, return_mode="median")))  # noqa: B023 (called at once)
            print(f"{s['scenario_id']} {c} | {side} | {k} | " + " | ".join(f"{v * 1e3:.2f}us" for v in r), flush=True)
            del sets
            torch.cuda.empty_cache()
