"""Words for counts in the command's reports: "1 tensor", "2 tensors", "1 value differs".

Example:
    >>> count(1, "tensor"), count(3, "tensor"), count(2, "key", "keys differ", "key differs")
    ('1 tensor', '3 tensors', '2 keys differ')
"""

from __future__ import annotations

__all__ = ["count"]


def count(n: int, singular: str, plural: str | None = None, one: str | None = None) -> str:
    """``n`` and the noun phrase that agrees with it: ``one`` (default ``singular``) for 1,
    ``plural`` (default ``singular + "s"``) otherwise."""
    if n == 1:
        return f"1 {one if one is not None else singular}"
    return f"{n} {plural if plural is not None else singular + 's'}"
