"""User-facing errors: one line that names the file or field and the fix."""


class KbNanoError(Exception):
    """A problem with the user's input (config, model, candidate, flag).

    The message is a single line naming the offending file/field and how to fix it;
    the CLI prints it as ``error: <message>`` and exits with status 2, without a
    traceback.
    """
