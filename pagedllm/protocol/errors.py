"""Errors that cross a process boundary and that every layer above the worker may catch."""


class WorkerError(RuntimeError):
    """The worker process failed; the message carries its traceback."""
