"""The errors a user can act on, shared by every floor: the CLI prints them as one line, exit code 2."""


class StageError(RuntimeError):
    """A stage cannot run: missing input, bad data, or a failed check."""


class LayoutError(StageError):
    """A run id or iteration that names no place in storage, or a run that does not exist."""
