"""Words for humans: a count with its noun, a size, a long name cut short."""

from __future__ import annotations

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
