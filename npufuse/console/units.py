"""Quantities as a person reads them."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """192 KiB, 1.5 MiB, 100 B: binary units, short."""
    n = float(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            v = n / scale
            text = f"{v:.0f}" if v >= 100 else f"{v:.1f}".removesuffix(".0")
            return f"{text} {unit}"
    return f"{n:.0f} B"
