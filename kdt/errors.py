"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class KdtError(Exception):
    """Bad input (file, config, argument): a one-line message for the user, never a traceback."""
