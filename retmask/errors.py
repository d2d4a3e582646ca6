"""The error type for a problem the user fixes.

:class:`UsageError` is a problem the user fixes (a flag, an input file, an output path, the machine): its
message names the problem and the fix, and every ``retmask`` command prints it as one line and exits with
code 2 (as the commands also do with the ``ValueError``s of their inputs and with an ``OSError`` naming a
file; ``retmask.commands.common.print_error``). It subclasses ``ValueError`` so code that already handles
bad values handles it too. Nothing here imports anything, so any layer may raise it.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A problem with the user's inputs, outputs or machine; the message says what and how to fix it."""
