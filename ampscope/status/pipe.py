"""A reader that stops reading: ``ampscope status | head -1`` closes the pipe once it has
its line, and the next write raises ``BrokenPipeError``. That is the reader's choice, not a
failure of ampscope: the command ends quietly, as ``cat`` and ``grep`` do."""

from __future__ import annotations

import os
import sys

EXIT_CLOSED_PIPE = 141
"""128 + SIGPIPE: what a shell reports for a command the closed pipe ended."""


def closed() -> int:
    """Point standard output at ``/dev/null`` and return ``EXIT_CLOSED_PIPE``.

    Call it when a write to standard output raised ``BrokenPipeError``: Python flushes
    ``sys.stdout`` again at exit, which would print "Exception ignored ... BrokenPipeError"
    without the redirection (the recipe of Python's ``signal`` documentation).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor (a test's StringIO): nothing to flush
        pass
    return EXIT_CLOSED_PIPE
