"""User-facing errors: one line that names the file or field and the fix."""


class KbNanoError(Exception):
    """A problem with the user's input (config, model, candidate, flag).

    The message is a single line naming the offending file/field and how to fix it;
    the CLI prints it as ``error: <message>`` and exits with status 2, without a
    traceback.
    """


def did_you_mean(name: str, known) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``known`` to a mistyped ``name``
    (``difflib``'s ratio >= 0.6), else ``""``."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
