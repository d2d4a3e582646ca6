"""The one error type the command line reports without a traceback.

:class:`UsageError` is a problem the user fixes (a flag, an input file, an output path, the machine): its
message names the problem and the fix, and every ``retmask`` command prints it and exits with code 2. It
subclasses ``ValueError`` so code that already handles bad values handles it too. Nothing here imports
anything, so any layer may raise it.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A problem with the user's inputs, outputs or machine; the message says what and how to fix it."""
