"""User-facing errors: one line that names the file or field and the fix."""


class KbNanoError(Exception):
    """A problem with the user's input (config, model, candidate, flag).

    The message is a single line naming the offending file/field and how to fix it;
    the CLI prints it as ``error: <message>`` and exits with status 2, without a
    traceback.
    """


class ConfigError(KbNanoError):
    """A bad value of the config key ``key`` (dotted for a section's key: ``e2e.output_json``).

    ``detail`` says what is wrong, led by the value where there is one
    (``results/kernels/x.json: that path belongs to ...``); the message is
    ``config <key>: <detail>`` (what the Snakefile reports), and the CLI names the flag or
    the config file that set the key instead (:func:`kb_nano.overrides.preflight`).
    """

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"config {key}: {detail}")
        self.key, self.detail = key, detail

    def __reduce__(self):
        return type(self), (self.key, self.detail)


def did_you_mean(name: str, known) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``known`` to a mistyped ``name``, else
    ``""``: ``difflib``'s similarity ratio >= 0.6 against each known name or against its
    first ``len(name) + 1`` characters, whichever is higher (a typo of a prefix, ``lama31``,
    then finds ``llama31-8b`` rather than a name of similar length); the first of equals."""
    from difflib import SequenceMatcher

    name = str(name)

    def score(k: str) -> float:
        return max(SequenceMatcher(None, name, k).ratio(), SequenceMatcher(None, name, k[: len(name) + 1]).ratio())

    best = max((str(k) for k in known), key=score, default=None)
    return f" (did you mean {best!r}?)" if best is not None and score(best) >= 0.6 else ""


def one_line(exc: BaseException) -> str | None:
    """The one line ``kb_nano`` prints for ``exc`` (as ``error: <line>``, with status 2): a
    ``KbNanoError``'s message, or for a ``NotADirectoryError``/``FileExistsError`` of a
    write under a file, that file and the fix (:func:`kb_nano.files.not_a_directory`);
    None for anything else (a real bug keeps its traceback)."""
    from pathlib import Path

    from kb_nano.files import blocking_file, not_a_directory

    if isinstance(exc, KbNanoError):
        return str(exc)
    filename = getattr(exc, "filename", None)
    blocker = blocking_file(Path(filename)) if filename else None
    return not_a_directory(blocker) if blocker is not None else None
