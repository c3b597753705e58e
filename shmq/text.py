"""Words for humans: a count with its noun, a size, a long name cut short, bytes as a line."""

from __future__ import annotations

import re

SHOWN_MAX = 40  # chars of a name an error message shows whole


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 worker``, ``2 workers`` (``nouns``: an irregular plural)."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def amount(n: float, unit: str) -> str:
    """``n`` of ``unit``: bytes in KiB, MiB or GiB, anything else as a whole count."""
    if unit == "bytes":
        for name, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if n >= 1 << shift:
                return f"{n / (1 << shift):.1f}".removesuffix(".0") + f" {name}"
    return f"{n:.0f} {unit}"


def shown(name: object) -> str:
    """``name`` for an error message: its repr, cut to its first ``SHOWN_MAX`` chars (and
    its length said) when longer."""
    if isinstance(name, str) and len(name) > SHOWN_MAX:
        return f"{name[:SHOWN_MAX]!r}… ({len(name)} chars)"
    return repr(name)



# shown escaped: the C0 and C1 controls (a tab only when escaping anyway), the backslash (so an
# escape is never ambiguous) and the bytes that are no UTF-8 (surrogateescape's U+DC80..U+DCFF)
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_ESCAPED = re.compile("[\x00-\x1f\x7f-\x9f\\\\\udc80-\udcff]")
_NAMED = {"\n": r"\n", "\r": r"\r", "\t": r"\t", "\\": "\\\\"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    n = ord(c)
    if c in _NAMED:
        return _NAMED[c]
    if n >= 0xDC80:  # a byte that is no UTF-8
        return f"\\x{n - 0xDC00:02x}"
    return f"\\x{n:02x}" if n < 0x80 else f"\\u{n:04x}"  # a C1 control: a character, not a byte


def as_line(data: bytes) -> tuple[str, str]:
    r"""``data`` as one line of text, and why it is escaped ("" when it shows as it is).
    UTF-8 text without control characters (a tab is fine) shows as it is; anything else
    escaped, the text around the escapes kept: ``\n``, ``\r``, ``\t``, ``\\``, ``\xNN`` for
    an ASCII control or a byte that is no UTF-8, ``\u0080``..``\u009f`` for a C1 control."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        why = "is not UTF-8"
    else:
        if not _CONTROL.search(text):
            return text, ""
        why = "has control characters"
    return _ESCAPED.sub(_escape, data.decode(errors="surrogateescape")), why
