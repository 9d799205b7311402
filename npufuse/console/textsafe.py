"""Text that is safe to print: names from a model (node, value, file names) may hold control characters
(`ESC]0;...` retitles a terminal window, `ESC[2J` clears the screen). Every text output goes through here."""

from __future__ import annotations

import re

# C0 controls, DEL and C1 controls (0x80-0x9f: 0x9b is a one-byte CSI on some terminals).
_CONTROL_ALL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# The same, but keeping the newline and tab a multi-line text is laid out with.
_CONTROL_KEEP_LAYOUT = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# What XML 1.0 forbids outright besides C0 controls: surrogates and U+FFFE/U+FFFF.
_XML_FORBIDDEN = re.compile("[\ud800-\udfff\ufffe\uffff]")


def _escape(m: re.Match) -> str:
    return f"\\x{ord(m.group()):02x}"


def safe_line(text: str) -> str:
    """`text` as one printable line: every control character (newline and tab too) written as `\\xNN`."""
    return _CONTROL_ALL.sub(_escape, text)


def safe_text(text: str) -> str:
    """Multi-line `text` with its layout (newlines, tabs) kept and every other control character written `\\xNN`."""
    return _CONTROL_KEEP_LAYOUT.sub(_escape, text)


def safe_xml_text(text: str) -> str:
    """`safe_text`, and characters XML 1.0 cannot hold (surrogates, U+FFFE, U+FFFF) written `\\uNNNN`."""
    return _XML_FORBIDDEN.sub(lambda m: f"\\u{ord(m.group()):04x}", safe_text(text))
