"""The one exception type the CLI turns into a one-line message and exit code 2."""


class AutoshardError(Exception):
    """A user-facing error: the message says what was wrong and what to do.

    The CLI prints ``error: <message>`` on one line and exits with code 2; ``--debug``
    shows the traceback too.
    """


class MemoryBudgetError(AutoshardError):
    """No plan fits the memory budget; ``least_bytes`` is the least any plan reaches (per
    device), which the message names."""

    def __init__(self, message: str, least_bytes: float) -> None:
        super().__init__(message)
        self.least_bytes = least_bytes


class ProgramTooLargeError(AutoshardError):
    """The ILP of a plan has more columns than the search was told to solve
    (``SolverOptions.max_columns``); ``columns`` and ``cap`` are the two counts."""

    def __init__(self, message: str, columns: int, cap: int) -> None:
        super().__init__(message)
        self.columns = columns
        self.cap = cap
