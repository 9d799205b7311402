"""Errors a user can act on. The CLI turns `InputError` into one line and exit code 2."""


class NpufuseError(Exception):
    """Base class of the errors npufuse raises on purpose."""


class InputError(NpufuseError):
    """Bad input or usage: what is wrong, where, and what to do, in one line (exit code 2)."""


class InconclusiveError(InputError):
    """A numeric check that could verify nothing (the original gives NaN/inf or empty outputs on the generated
    inputs): exit code 2 like other bad input. `result` is what the run produced, for its summary."""

    def __init__(self, message: str, result: object) -> None:
        super().__init__(message)
        self.result = result


class DriftError(NpufuseError):
    """The optimized model drifts from the original (exit code 1; nothing written). `result` holds the run,
    its report and the whole-model comparison."""

    def __init__(self, message: str, result: object) -> None:
        super().__init__(message)
        self.result = result


EXIT_OK, EXIT_DRIFT, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program Ctrl-C stopped


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (onnxruntime's run to dozens), for one-line errors."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


def parse_dims(dims: tuple[str, ...] | list[str]) -> dict[str, int]:
    """`--dim NAME=INT` values as a dict; a malformed one, or a size < 1, is a usage error."""
    import re

    out = {}
    for d in dims:
        name, sep, value = d.partition("=")
        # ASCII digits only: str.isdigit() accepts '²' and other Unicode digits that int() then rejects, and a
        # number past 18 digits is no size any machine holds (int() of thousands of digits is refused anyway).
        if not sep or not name.strip() or not re.fullmatch(r"[0-9]{1,18}", value.strip()) or int(value) < 1:
            raise InputError(f"--dim {d!r}: expected NAME=INT with INT >= 1, e.g. --dim batch=1 --dim sequence=128")
        out[name.strip()] = int(value)
    return out


_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
               "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str, option: str) -> int:
    """`1GiB`, `512MiB`, `2G`, `1.5GB` or plain bytes as an int; anything else is a usage error."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS or float(m.group(1)) * _SIZE_UNITS[unit] < 1:
        raise InputError(f"{option} {text!r}: expected a size such as 1GiB, 512MiB or 2000000000")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])
