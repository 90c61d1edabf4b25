"""A target sparsity as one typed value: a fraction of zeros, or an N:M pattern.

Every way a sparsity enters (``--sparsity 2:4``, a YAML list, a callback's init argument, the
Python API) goes through :meth:`Sparsity.parse` once; everything below takes the parsed value and
checks nothing again. One mistake, one message.

YAML 1.1 reads an unquoted ``a:b`` as the base-60 (sexagesimal) number ``60·a + b`` (``2:4`` →
124), so an N:M pattern written without quotes arrives as a large whole number: the message says so.

This module imports nothing heavy: the command line parses sparsities before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fairprune.errors import UserError


@dataclass(frozen=True)
class Sparsity:
    """``fraction`` of zeros in [0, 1); for an N:M pattern ``n`` of every ``m`` consecutive inputs
    of a row are zero (``fraction`` = n / m)."""

    fraction: float
    n: int | None = None
    m: int | None = None

    @property
    def nm(self) -> tuple[int, int] | None:
        """``(N, M)`` for a pattern, None for a fraction."""
        return None if self.n is None else (self.n, self.m)

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.n is not None else repr(self.fraction)

    @property
    def label(self) -> str:
        """The sparsity in a folder name: ``0.5``, ``2of4``."""
        return str(self).replace(":", "of")

    @classmethod
    def parse(cls, value: Any, *, what: str = "sparsity", nm: bool = True) -> Sparsity:
        """``0.5`` / ``"0.5"`` → 50 % zeros; ``"2:4"`` → 2 of every 4. ``nm=False``: fractions only
        (vision pruning). A :class:`Sparsity` passes through as it is (it was parsed already)."""
        if isinstance(value, Sparsity):
            if value.nm is not None and not nm:
                raise UserError(_no_patterns(what, value))
            return value
        if isinstance(value, str) and ":" in value:
            if not nm:
                raise UserError(_no_patterns(what, value))
            try:
                n, m = (int(part) for part in value.split(":"))
            except ValueError:
                raise UserError(f"{what} N:M must be two whole numbers like 2:4, got '{value}'") from None
            if not 0 < n < m:
                raise UserError(f"{what} N:M needs 1 <= N < M, got {value}; e.g. 2:4")
            return cls(n / m, n, m)
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise UserError(f"{what} must be a fraction in [0, 1){_or_nm(nm)}, got '{value}'") from None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise UserError(f"{what} must be a fraction in [0, 1){_or_nm(nm)}, got {value!r}")
        if 0.0 <= number < 1.0:
            return cls(float(number))
        hint = ""
        if number >= 60 and float(number).is_integer():
            a, b = divmod(int(number), 60)
            hint = (f" (YAML reads an unquoted {a}:{b} as the base-60 (sexagesimal) number {int(number)}; "
                    + ("quote the pattern: \"2:4\")" if nm else "vision pruning takes a fraction of weights, not an N:M pattern)"))
        raise UserError(f"{what} must be a fraction in [0, 1), e.g. 0.9 for 90 % zeros{_or_nm(nm)}, got {value!r}{hint}")


def _or_nm(nm: bool) -> str:
    return " or an N:M pattern like 2:4" if nm else ""


def _no_patterns(what: str, value: Any) -> str:
    return (f"{what} must be a fraction in [0, 1), got '{value}': vision pruning takes a fraction of weights, "
            "not an N:M pattern (N:M is for LM pruning)")
