"""The error the ``kvbridge`` command prints as one line (exit status 2).

Its own module so that ``kvbridge.cli`` and the commands it registers (``kvbridge.bench``) both
raise it without importing each other.
"""

from __future__ import annotations


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""
