"""JSON in and out without changing a number (case F11).

A tool's JSON may hold integers wider than 64 bits and decimals with more digits than a
double keeps (``123456789012345678901234567890``, ``0.10000000000000000001``).
PostgreSQL's jsonb stores them exactly (``numeric``); a parse into Python floats and a
second encode would not. ``loads`` reads such a number as an ``ExactNumber`` holding its
literal text, and ``dumps`` writes it back digit for digit. Everything else is orjson's
fast path: a document is re-read the careful way only when it contains a run of 16 or
more digits and dots or a digit before an exponent (``1e-400`` underflows a double), the
shortest texts that can hold a number a double or a 64-bit integer would change.
A number beyond a double's range (a 400-digit integer, ``1e400``), which orjson refuses,
is read the careful way too: it is valid JSON, and jsonb stores it exactly.

Untrusted input (a payload, a tool's result or checkpoint) is read with ``bounded=True``:
a number PostgreSQL's numeric cannot store, or a document whose numbers grow by more than
MAX_NUMBER_GROWTH bytes written out in full (jsonb stores ``1e400`` as 401 digits),
raises ``NumberOutOfRange`` saying so (case F24).
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from typing import Any

import orjson

# 15 significant digits always survive a double; 16 or more may not, and a 64-bit integer
# has at most 20 digits. Digits inside strings also match: harmless, just the slow path.
_MAYBE_INEXACT = re.compile(r"[0-9][0-9.]{15}|[0-9][eE]")
# The same test on bytes, as substring searches in the document's number_shape: CPython's
# re scans about 10 ms per 512 KiB for such a pattern, holding the GIL (and so the
# sidecar's event loop, which heartbeats); a translate and a find take about 1 ms.
_SHAPE = bytes(ord("0") if chr(c) in "0123456789." else ord("e") if chr(c) in "eE"
               else ord("+") if chr(c) in "+-" else ord(" ") for c in range(256))


def number_shape(data: bytes | bytearray | memoryview) -> bytes:
    """``data`` (JSON as UTF-8 bytes) with every digit and ``.`` as ``0``, ``e``/``E`` as
    ``e``, ``+``/``-`` as ``+`` and every other byte as a space, at the same offsets: a
    number's layout becomes a plain substring search. A run of n ``0`` is then at least an
    n-character run of digits and dots in the text (the searches built on it may match
    more than they must, never less)."""
    if isinstance(data, memoryview):
        data = bytes(data)
    return bytes(data.translate(_SHAPE))


def _maybe_inexact(shape: bytes) -> bool:
    return b"0" * 16 in shape or b"0e" in shape


# A bounded read refuses what PostgreSQL's numeric (jsonb's numbers) cannot store: more
# than 131072 digits before the decimal point or 16383 after it (``1e-20000``) ...
NUMERIC_MAX_DIGITS, NUMERIC_MAX_SCALE = 131072, 16383
# ... and a document whose numbers, written out in full as jsonb stores them, are this
# many bytes longer than written (``1e16000`` is 7 bytes of JSON and 16001 in the row).
MAX_NUMBER_GROWTH = 1 << 20


class NumberOutOfRange(ValueError):
    """A valid JSON number that a bounded read refuses; the message says why and what to
    send instead (case F24)."""


def _written_out(text: str) -> tuple[int, int]:
    """Digits of the JSON number ``text`` before and after the decimal point written out in
    full, as jsonb stores it (``1e3`` -> (4, 0), ``1.5e-3`` -> (1, 4): ``0.0015``)."""
    try:
        _sign, digits, exponent = Decimal(text).as_tuple()
    except (ValueError, ArithmeticError):
        exponent = None
    if not isinstance(exponent, int):
        return NUMERIC_MAX_DIGITS + 1, 0
    return max(len(digits) + exponent, 1), max(-exponent, 0)


class _Budget:
    """Checks every number of one bounded read (see NUMERIC_MAX_DIGITS)."""

    __slots__ = ("growth",)

    def __init__(self) -> None:
        self.growth = 0

    def check(self, text: str) -> None:
        shown = text[:24] + ("..." if len(text) > 24 else "")
        whole, fraction = (len(text.lstrip("-")), 0) if text.lstrip("-").isdigit() \
            else _written_out(text)
        if whole > NUMERIC_MAX_DIGITS or fraction > NUMERIC_MAX_SCALE:
            raise NumberOutOfRange(
                f"the number {shown} has {whole} digits before the decimal point and "
                f"{fraction} after it written out in full; PostgreSQL's jsonb (numeric) "
                f"stores at most {NUMERIC_MAX_DIGITS} and {NUMERIC_MAX_SCALE}: send it as "
                "a string")
        self.growth += max(whole + fraction - len(text), 0)
        if self.growth > MAX_NUMBER_GROWTH:
            raise NumberOutOfRange(
                f"the numbers' exponents make the document more than {MAX_NUMBER_GROWTH} "
                "bytes longer written out in full, as PostgreSQL's jsonb stores them: send "
                "such numbers as strings")


_INT64_MIN, _UINT64_MAX = -(2 ** 63), 2 ** 64 - 1


class ExactNumber:
    """A JSON number kept as its literal ``text`` because no int or float holds it
    exactly. Compares equal to another with the same value; ``dumps`` writes ``text``."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ExactNumber):
            return Decimal(self.text) == Decimal(other.text)
        if isinstance(other, int | float) and not isinstance(other, bool):
            return Decimal(self.text) == Decimal(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(Decimal(self.text))

    def __float__(self) -> float:
        return float(self.text)

    def __repr__(self) -> str:
        return f"ExactNumber({self.text!r})"


def _exact_int(text: str) -> int | ExactNumber:
    if len(text) > 24:  # wider than 64 bits (and no int() of thousands of digits)
        return ExactNumber(text)
    value = int(text)
    return value if _INT64_MIN <= value <= _UINT64_MAX else ExactNumber(text)


def _exact_float(text: str) -> float | ExactNumber:
    try:
        value = float(text)
    except OverflowError:  # not raised by CPython (it gives inf); kept for safety
        return ExactNumber(text)
    try:
        same = Decimal(repr(value)) == Decimal(text)
    except InvalidOperation:  # inf: outside a double's range
        same = False
    return value if same else ExactNumber(text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(data: bytes | bytearray | memoryview | str, shape: bytes | None = None, *,
          bounded: bool = False) -> Any:
    """Parse one JSON document (UTF-8 bytes or text) into Python values, numbers that an
    int or float would change as ``ExactNumber``. ``shape`` is ``number_shape(data)`` when
    the caller has it already (bytes only). Raises ``orjson.JSONDecodeError`` (a
    ``ValueError``) for anything that is not one JSON value, and with ``bounded`` (untrusted
    input) ``NumberOutOfRange`` (a ``ValueError``) for a number jsonb cannot store or an
    exponent-blown document (see _Budget).

    A document nested deeper than the interpreter's recursion limit (about 1,000 levels;
    orjson allows 1,024) is returned as orjson reads it, numbers as floats."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        # orjson refuses a number beyond a double's range; it is valid JSON all the same.
        if "number" not in str(exc):
            raise
        value = None
    else:
        if isinstance(data, str):
            if not _MAYBE_INEXACT.search(data):
                return value
        elif not _maybe_inexact(number_shape(data) if shape is None else shape):
            return value
    text = data if isinstance(data, str) else str(data, "utf-8")
    parse_int, parse_float = _exact_int, _exact_float
    if bounded:
        budget = _Budget()

        def parse_int(text: str) -> int | ExactNumber:
            budget.check(text)
            return _exact_int(text)

        def parse_float(text: str) -> float | ExactNumber:
            budget.check(text)
            return _exact_float(text)
    try:
        return json.loads(text, parse_int=parse_int, parse_float=parse_float,
                          parse_constant=_no_constant)
    except RecursionError:
        if value is None:
            raise ValueError("nested too deep to read its numbers exactly") from None
        return value


def _default(value: Any) -> Any:
    if isinstance(value, ExactNumber):
        return orjson.Fragment(value.text)
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def _default_str(value: Any) -> Any:
    if isinstance(value, ExactNumber):
        return orjson.Fragment(value.text)
    return str(value)


def dumps(value: Any, *, option: int = 0, other_as_str: bool = False) -> bytes:
    """``orjson.dumps`` that writes every ``ExactNumber`` digit for digit. With
    ``other_as_str`` any other type orjson cannot encode is written as its ``str()``
    (dates, UUIDs of asyncpg rows); without it, such a value raises ``TypeError``."""
    return orjson.dumps(value, default=_default_str if other_as_str else _default,
                        option=option)
