"""A worker's reply as the judge reads it: the verdicts a candidate's worker may report about
its own candidate (anything else it sends is forged: ``tampered``), and :class:`Verdict`,
which ends a measurement early with a status."""

from __future__ import annotations

from kb_nano.kernels.pool import WorkerHandle


class Verdict(Exception):
    """Ends a measurement early with ``status`` and ``message`` (and row ``fields``)."""

    def __init__(self, status: str, message: str, **fields) -> None:
        super().__init__(message)
        self.status, self.message, self.fields = status, message, fields


# what a candidate's worker may report about its own candidate (anything else is forged)
WORKER_VERDICTS = {
    "import_error",
    "skipped",
    "runtime_error",
    "incorrect_shape",
    "tampered",
    "invalid_output",
    "output_aliased",
    "input_mutated",
    "unsynced_work",
}


def ask(worker: WorkerHandle, msg: dict, deadline: float, shared=None) -> dict:
    """``worker``'s reply to ``msg``. Raises :class:`Verdict` when a candidate's worker
    reports a violation (``tampered`` when it is not one a worker sends), ``RuntimeError``
    when the baseline's does; ``WorkerGone`` / ``WorkerTimeout`` from the request."""
    reply = worker.request(msg, deadline, shared)
    found = reply.get("violation")
    if found:
        if worker.role == "baseline":
            raise RuntimeError(f"the baseline failed: {found}")
        if not (
            isinstance(found, list) and len(found) == 2 and found[0] in WORKER_VERDICTS and isinstance(found[1], str)
        ):
            raise Verdict("tampered", f"the candidate's worker sent a verdict no worker sends ({str(found)[:80]})")
        raise Verdict(found[0], found[1][:1000])
    return reply
