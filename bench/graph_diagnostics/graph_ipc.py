"""Graph time of the same calls on inputs received through CUDA IPC vs allocated locally."""

import argparse
import sys

sys.path.insert(0, "bench")
sys.path.insert(0, "src")
import fidelity as F
import torch
import torch.multiprocessing as mp

from kb_nano.kernels import timing


def rows():
    a = argparse.Namespace(
        model="llama31-8b",
        num_tokens=[1, 64, 1024],
        context_lens=[1024],
        targets=["rms_norm", "silu_and_mul", "attention"],
        max_decode_tokens=0,
        max_prefill_tokens=64,
    )
    want = {"rms_norm/torch_fused", "silu_and_mul/inplace", "attention/gqa_grouped"}
    return [(s, c) for s, c in F.rows_of(a) if c in want and not s.get("context_len")]


def producer(q, done, k):
    dev = torch.device("cuda")
    for s, _c in rows():
        sets = F.input_sets(s, dev, k)
        torch.cuda.synchronize()
        q.put(sets)
        done.wait()
        done.clear()
    q.put(None)


def kb_graph(m, sets, dev, flush=None):
    g, outs = timing.capture_graph(lambda i: m(*sets[i]), range(len(sets)), dev)
    replays = max(1, 2000 // len(sets))
    res = sorted(timing.time_graph(g, dev, flush, replays) / replays / len(sets) for _ in range(9))
    del g, outs
    return res[4]


if __name__ == "__main__":
    mp.set_start_method("spawn")
    dev = torch.device("cuda")
    k = 64
    q, done = mp.Queue(), mp.Event()
    p = mp.Process(target=producer, args=(q, done, k))
    p.start()
    flush = timing.L2Flush(dev)
    print("row | IPC inputs | local clones | local clones + flush | IPC + flush")
    with torch.inference_mode():
        for s, c in rows():
            sets = q.get()
            m = F.modules(s, c, dev)["baseline"]
            local = [[t.clone() for t in st] for st in sets]
            r = [
                kb_graph(m, sets, dev),
                kb_graph(m, local, dev),
                kb_graph(m, local, dev, flush),
                kb_graph(m, sets, dev, flush),
            ]
            print(s["scenario_id"], c, "baseline |", " | ".join(f"{v * 1e3:.2f}us" for v in r), flush=True)
            del sets, local
            torch.cuda.empty_cache()
            done.set()
    q.get()
    p.join()
