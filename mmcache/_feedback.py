"""Numbers in words for the library's messages: counts with their noun, sizes in bytes.

Counts come with their noun in the right number ("1 image", "2 classes"), byte sizes in
decimal units.
"""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``count(1, "image")`` -> ``"1 image"``; ``count(1000, "class", "classes")`` -> ``"1,000
    classes"`` (the plural defaults to the noun plus "s")."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def human_bytes(n: float) -> str:
    """``1234567`` -> ``"1.23 MB"`` (decimal units, as disk vendors and ``df -H`` count)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
