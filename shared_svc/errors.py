"""Errors that end a command with a one-line message instead of a traceback."""


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""
