"""Quantities with units: bandwidth, duration and size, as the user writes them.

Parsers turn ``"450GB/s"``, ``"5us"`` and ``"40GiB"`` into plain SI numbers (bytes/s, seconds,
bytes); formatters turn those numbers back into short text that always carries its unit. Each
parser has a :class:`click.ParamType` so that the CLI reports a bad value as a usage error.

Prefixes follow IEC 80000-13: ``K``/``k``, ``M``, ``G``, ``T`` are powers of 1000 and ``Ki``,
``Mi``, ``Gi``, ``Ti`` powers of 1024. ``B`` is a byte and ``b`` a bit (bandwidth only), so
``Gb/s`` is an eighth of ``GB/s``: the case of ``b``/``B`` matters, and so does ``M`` (mega)
against ``m`` (milli, durations only).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

import click

from autoshard.errors import AutoshardError

__all__ = [
    "BANDWIDTH",
    "BYTES",
    "DURATION",
    "BandwidthType",
    "BytesType",
    "DurationType",
    "format_bandwidth",
    "format_bytes",
    "format_seconds",
    "parse_bandwidth",
    "parse_bytes",
    "parse_duration",
]

# A non-negative decimal number, optionally in scientific notation, then an optional unit.
_QUANTITY = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(\S*)\s*$")

# Multipliers are exact decimals, so "5us" is exactly the float nearest 5e-6.
_DECIMAL = {"": 1, "K": 10**3, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}

# Multiplier to bytes, for each size unit: B, KB..TB (kB too), KiB..TiB.
_BYTE_UNITS: dict[str, Decimal] = {f"{p}B": Decimal(f) for p, f in (_DECIMAL | _BINARY).items()}

# Multiplier to bytes/s, for each bandwidth unit: bytes (B/s, GB/s, GiB/s, ...) and bits
# (b/s, Gb/s, Gbit/s, Gbps, ...; a bit is 1/8 byte).
_BANDWIDTH_UNITS: dict[str, Decimal] = {f"{u}/s": f for u, f in _BYTE_UNITS.items()}
for _p, _f in _DECIMAL.items():
    for _bit in (f"{_p}b/s", f"{_p}bit/s", f"{_p}bps"):
        _BANDWIDTH_UNITS[_bit] = Decimal(_f) / 8

# Multiplier to seconds. Both the micro sign (U+00B5) and the Greek mu (U+03BC) are accepted.
_DURATION_UNITS: dict[str, Decimal] = {
    "s": Decimal(1),
    "ms": Decimal("1e-3"),
    "us": Decimal("1e-6"),
    "\u00b5s": Decimal("1e-6"),
    "\u03bcs": Decimal("1e-6"),
    "ns": Decimal("1e-9"),
}

_BANDWIDTH_HINT = "B/s, KB/s..TB/s, KiB/s..TiB/s, or bits: b/s..Tb/s (also Gbit/s, Gbps)"
_DURATION_HINT = "s, ms, us (or \u00b5s), ns"
_BYTES_HINT = "B, KB..TB, KiB..TiB"


def _parse(text: str, units: dict[str, Decimal], what: str, hint: str, example: str) -> float:
    """``text`` -> number times its unit's multiplier; errors name ``what`` and ``example``."""
    m = _QUANTITY.match(text) if isinstance(text, str) else None
    if m is None:
        raise AutoshardError(
            f"bad {what} {text!r}: write a non-negative number with a unit, e.g. {example}"
        )
    number, unit = m.groups()
    if unit == "" and Decimal(number) == 0:
        return 0.0  # zero is zero in every unit (--bucket-size 0, as the docs write it)
    if unit == "":
        raise AutoshardError(f"{what} {text!r} has no unit: write it with one, e.g. {example}")
    if unit not in units:
        raise AutoshardError(
            f"unknown unit {unit!r} in {what} {text!r}: use {hint} (e.g. {example})"
        )
    value = float(Decimal(number) * units[unit])
    if not math.isfinite(value):
        raise AutoshardError(f"{what} {text!r} is too large: write a finite value, e.g. {example}")
    return value


def parse_bandwidth(text: str) -> float:
    """Parse a bandwidth such as ``"450GB/s"``, ``"400Gb/s"`` or ``"10 GiB/s"``.

    Units: ``B/s KB/s MB/s GB/s TB/s`` (powers of 1000), ``KiB/s MiB/s GiB/s TiB/s`` (powers of
    1024), and bits ``b/s Kb/s Mb/s Gb/s Tb/s``, also written ``Gbit/s`` or ``Gbps`` (divided
    by 8).

    Returns:
        Bytes per second (float), e.g. ``parse_bandwidth("400Gb/s") == 50e9``.

    Raises:
        AutoshardError: no number, no unit, an unknown unit, or a bandwidth of zero.
    """
    value = _parse(text, _BANDWIDTH_UNITS, "bandwidth", _BANDWIDTH_HINT, "450GB/s")
    if value == 0:
        raise AutoshardError(f"bandwidth {text!r} is zero: give a positive one, e.g. 450GB/s")
    return value


def parse_duration(text: str) -> float:
    """Parse a duration such as ``"5us"``, ``"1.5 ms"`` or ``"2s"``.

    Units: ``s``, ``ms``, ``us`` (or ``µs``), ``ns``.

    Returns:
        Seconds (float), e.g. ``parse_duration("5us") == 5e-6``.

    Raises:
        AutoshardError: no number, no unit, or an unknown unit.
    """
    return _parse(text, _DURATION_UNITS, "duration", _DURATION_HINT, "5us")


def parse_bytes(text: str) -> int:
    """Parse a size such as ``"40GiB"``, ``"80GB"`` or ``"512 B"``.

    Units: ``B``, ``KB MB GB TB`` (powers of 1000; ``kB`` too), ``KiB MiB GiB TiB`` (powers of
    1024).

    Returns:
        Bytes (int), e.g. ``parse_bytes("1.5KiB") == 1536``.

    Raises:
        AutoshardError: no number, no unit, an unknown unit, or a fraction of a byte
        (``"1.5B"``).
    """
    value = _parse(text, _BYTE_UNITS, "size", _BYTES_HINT, "40GiB")
    if value != int(value):
        raise AutoshardError(
            f"size {text!r} is not a whole number of bytes ({value:g} B): write e.g. 40GiB"
        )
    return int(value)


def _three_digits(value: float) -> str:
    """About three significant digits: 123, 12.3, 1.23."""
    a = abs(value)
    if a >= 99.95:
        return f"{value:.0f}"
    if a >= 9.995:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_bytes(n: float) -> str:
    """Size in binary units: ``format_bytes(1.5 * 2**30) == "1.50 GiB"``, ``512 -> "512 B"``."""
    if not math.isfinite(n):
        return f"{n} B"
    a = abs(n)
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if a >= mult:
            return f"{_three_digits(n / mult)} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    """Duration in s, ms, us or ns: ``0.0123 -> "12.3 ms"``, ``5e-6 -> "5.00 us"``, ``0 -> "0 s"``.

    ``inf`` (an impossible resharding) prints as ``"inf s"``.
    """
    if s == 0:
        return "0 s"
    if not math.isfinite(s):
        return f"{s} s"
    a = abs(s)
    for unit, mult in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if a >= mult * 0.9995:
            return f"{_three_digits(s / mult)} {unit}"
    return f"{_three_digits(s / 1e-9)} ns"


def format_bandwidth(bps: float) -> str:
    """Bandwidth in decimal byte units: ``450e9 -> "450 GB/s"``, ``5e10 -> "50.0 GB/s"``."""
    a = abs(bps)
    for unit, mult in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if a >= mult * 0.9995:
            return f"{_three_digits(bps / mult)} {unit}"
    return f"{_three_digits(bps)} B/s"


class _QuantityType(click.ParamType):
    """A click parameter that parses text with :meth:`parse`; errors become usage errors."""

    def parse(self, text: str) -> float | int:
        raise NotImplementedError

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> float | int:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value  # already in base units (a default given as a number)
        try:
            return self.parse(value)  # type: ignore[arg-type]
        except AutoshardError as e:
            self.fail(str(e), param, ctx)


class BandwidthType(_QuantityType):
    """Click type for a bandwidth (``450GB/s``) -> float bytes/s; see :func:`parse_bandwidth`."""

    name = "bandwidth"

    def parse(self, text: str) -> float:
        return parse_bandwidth(text)


class DurationType(_QuantityType):
    """Click type for a duration (``5us``) -> float seconds; see :func:`parse_duration`."""

    name = "duration"

    def parse(self, text: str) -> float:
        return parse_duration(text)


class BytesType(_QuantityType):
    """Click type for a size (``40GiB``) -> int bytes; see :func:`parse_bytes`."""

    name = "size"

    def parse(self, text: str) -> int:
        return parse_bytes(text)


BANDWIDTH = BandwidthType()
DURATION = DurationType()
BYTES = BytesType()
