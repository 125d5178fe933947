"""The one exception type for bad input: its message is a single line that names
the file, field or flag at fault; the CLI prints it and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (a file, a config field, a flag)."""


class CacheError(RuntimeError):
    """A KV cache was asked to roll back what it cannot."""
