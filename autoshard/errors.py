"""The one exception type the CLI turns into a one-line message and exit code 2."""


class AutoshardError(Exception):
    """A user-facing error: the message says what was wrong and what to do.

    The CLI prints ``error: <message>`` on one line and exits with code 2; ``--debug``
    shows the traceback too.
    """
