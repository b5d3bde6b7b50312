"""Does a graph replay read faster after the GPU has idled? kb-nano's graph method
(``capture_graph`` + ``time_graph``, K = 16 input sets, 20 replays a measurement, L2
flushed) on the 1-token baselines of graph_ctx.py's rows, in a plain process: nine
measurements in a row after an idle gap of 0, 5 ms, 50 ms, 200 ms and 1 s before each,
every measurement printed in order (us per call), then ``do_bench_cudagraph`` after 1 s idle.

    PYTHONPATH=src:tests python3 bench/graph_diagnostics/graph_idle.py
"""

import sys
import time

sys.path.insert(0, "bench")
sys.path.insert(0, "bench/graph_diagnostics")
import fidelity as F
import torch
import triton.testing
from graph_ctx import rows

from kb_nano.kernels import timing

if __name__ == "__main__":
    dev = torch.device("cuda")
    flush = timing.L2Flush(dev)
    with torch.inference_mode():
        for s, c in rows():
            if s["num_tokens"] != 1:
                continue
            m = F.modules(s, c, dev)["baseline"]
            sets = F.input_sets(s, dev, 16)
            g, outs = timing.capture_graph(lambda i, m=m, sets=sets: m(*sets[i]), range(16), dev)
            for gap in (0.0, 0.005, 0.05, 0.2, 1.0):
                seq = []
                for _ in range(9):
                    time.sleep(gap)
                    seq.append(timing.time_graph(g, dev, flush, 20) / 20 / 16 * 1e3)
                print(f"{s['scenario_id']} gap {gap * 1e3:.0f} ms:", " ".join(f"{v:.2f}" for v in seq), flush=True)
            time.sleep(1.0)
            i = [0]

            def fn(m=m, sets=sets, i=i):
                m(*sets[i[0] % 16])
                i[0] += 1

            d = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
            print(f"{s['scenario_id']} do_bench_cudagraph after 1 s idle: {d:.2f}", flush=True)
