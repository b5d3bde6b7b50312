"""Worker process of one kernel job: ``python -m kb_nano.worker SPEC.json``.

Runs :func:`kb_nano.bench.measure` and writes the row as a Parquet shard. It runs in a
process of its own so that a candidate that segfaults, hangs or exhausts memory only
takes this process down; :mod:`kb_nano.kernel_job` then records ``crashed``/``timeout``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the job process that started it dies
    (``prctl(PR_SET_PDEATHSIG)``), so an interrupted sweep leaves no orphan that could
    later write a stale shard. No-op elsewhere."""
    import ctypes
    import os
    import signal

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: list[str]) -> int:
    """Entry point; ``argv[0]`` is the path of the JSON job spec."""
    _die_with_parent()
    spec = json.loads(Path(argv[0]).read_text())
    from kb_nano.bench import measure
    from kb_nano.schema import write_rows

    row = measure(spec["scenario"], spec["candidate_id"], Path(spec["candidate_path"]), spec["settings"], Path(spec["root"]))
    row["gpu_ids"] = spec.get("gpu_ids")  # leased by the job process (kb_nano.gpus)
    write_rows([row], Path(spec["output"]))
    print(f"{row['scenario_id']} {row['candidate']}: {row['status']}" + (f" ({row['error']})" if row["error"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
