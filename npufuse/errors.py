"""Errors a user can act on. The CLI turns `InputError` into one line and exit code 2."""


class NpufuseError(Exception):
    """Base class of the errors npufuse raises on purpose."""


class InputError(NpufuseError):
    """Bad input or usage: what is wrong, where, and what to do, in one line (exit code 2)."""


class VerificationError(NpufuseError):
    """A numeric check failed where failing is final (exit code 1)."""
