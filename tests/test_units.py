"""Units: exact parsed values, every error path, formatting, and the click types."""

import math

import click
import pytest
from click.testing import CliRunner

from autoshard.errors import AutoshardError
from autoshard.units import (
    BANDWIDTH,
    BYTES,
    DURATION,
    format_bandwidth,
    format_bytes,
    format_seconds,
    parse_bandwidth,
    parse_bytes,
    parse_duration,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("450GB/s", 450e9),
        ("450 GB/s", 450e9),
        ("1.5TB/s", 1.5e12),
        ("2e2MB/s", 200e6),
        ("10kB/s", 10_000.0),
        ("7B/s", 7.0),
        ("1GiB/s", 2.0**30),
        ("3KiB/s", 3 * 1024.0),
        ("400Gb/s", 50e9),  # 400e9 bits / 8
        ("400Gbit/s", 50e9),
        ("400Gbps", 50e9),
        ("8b/s", 1.0),
        ("100Mb/s", 12.5e6),
    ],
)
def test_parse_bandwidth(text: str, expected: float) -> None:
    assert parse_bandwidth(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [("5us", 5e-6), ("5µs", 5e-6), ("5μs", 5e-6), ("1.5ms", 1.5e-3), ("2s", 2.0), ("300ns", 3e-7)],
)
def test_parse_duration(text: str, expected: float) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("40GiB", 40 * 2**30),
        ("80GB", 80 * 10**9),
        ("512 B", 512),
        ("1.5KiB", 1536),
        ("1.1KB", 1100),
        ("2TiB", 2 * 2**40),
        ("3MB", 3_000_000),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    value = parse_bytes(text)
    assert value == expected and isinstance(value, int)


def test_zero_needs_no_unit() -> None:
    """``--bucket-size 0`` as solve.md and ``--help`` write it (it was refused for its
    missing unit); a zero bandwidth is still refused, as zero, not for its unit."""
    assert parse_bytes("0") == 0 and isinstance(parse_bytes("0"), int)
    assert parse_duration("0") == 0.0 and parse_duration("0.0") == 0.0
    with pytest.raises(AutoshardError, match="is zero"):
        parse_bandwidth("0")


@pytest.mark.parametrize(
    "parse, text, message",
    [
        (parse_bandwidth, "450", "has no unit"),
        (parse_bandwidth, "450gb/s", "unknown unit 'gb/s'"),  # b/B case matters
        (parse_bandwidth, "450GB", "unknown unit 'GB'"),  # a size, not a bandwidth
        (parse_bandwidth, "fast", "bad bandwidth 'fast'"),
        (parse_bandwidth, "-5GB/s", "bad bandwidth"),
        (parse_bandwidth, "0GB/s", "is zero"),
        (parse_bandwidth, "1e400GB/s", "too large"),
        (parse_duration, "5", "has no unit"),
        (parse_duration, "5 min", "unknown unit 'min'"),
        (parse_duration, "5Ms", "unknown unit 'Ms'"),  # mega, not milli
        (parse_bytes, "40", "has no unit"),
        (parse_bytes, "40gib", "unknown unit 'gib'"),
        (parse_bytes, "40Gb", "unknown unit 'Gb'"),  # bits are not a size
        (parse_bytes, "1.5B", "not a whole number of bytes"),
        (parse_bytes, "", "bad size"),
    ],
)
def test_parse_errors_name_the_text_and_give_an_example(parse, text, message) -> None:
    with pytest.raises(AutoshardError, match=message) as info:
        parse(text)
    text_shown = repr(text)
    assert text_shown in str(info.value)
    assert "e.g." in str(info.value)


@pytest.mark.parametrize(
    "n, expected",
    [
        (0, "0 B"),
        (512, "512 B"),
        (1536, "1.50 KiB"),
        (1.5 * 2**30, "1.50 GiB"),
        (12.34 * 2**20, "12.3 MiB"),
        (450 * 2**30, "450 GiB"),
        (3 * 2**40, "3.00 TiB"),
    ],
)
def test_format_bytes(n: float, expected: str) -> None:
    assert format_bytes(n) == expected


@pytest.mark.parametrize(
    "s, expected",
    [
        (0.0, "0 s"),
        (2.5, "2.50 s"),
        (0.0123, "12.3 ms"),
        (0.456, "456 ms"),
        (5e-6, "5.00 us"),
        (12.5e-6, "12.5 us"),
        (4e-7, "400 ns"),
        (math.inf, "inf s"),
    ],
)
def test_format_seconds(s: float, expected: str) -> None:
    assert format_seconds(s) == expected


@pytest.mark.parametrize(
    "bps, expected",
    [(450e9, "450 GB/s"), (50e9, "50.0 GB/s"), (1.5e12, "1.50 TB/s"), (12.5e6, "12.5 MB/s")],
)
def test_format_bandwidth(bps: float, expected: str) -> None:
    assert format_bandwidth(bps) == expected


def test_formatting_round_trips_through_the_parser() -> None:
    assert parse_bandwidth(format_bandwidth(450e9).replace(" ", "")) == 450e9
    assert parse_bytes(format_bytes(1.5 * 2**30).replace(" ", "")) == 1.5 * 2**30


@click.command()
@click.option("--bw", type=BANDWIDTH, default=450e9)
@click.option("--lat", type=DURATION, default="5us")
@click.option("--budget", type=BYTES, default=None)
def _cmd(bw: float, lat: float, budget: int | None) -> None:
    click.echo(f"{bw!r} {lat!r} {budget!r}")


def test_click_types_convert_values_and_defaults() -> None:
    result = CliRunner().invoke(_cmd, ["--bw", "400Gb/s", "--budget", "1KiB"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "50000000000.0 5e-06 1024"
    # A numeric default passes through untouched.
    assert CliRunner().invoke(_cmd, []).output.strip() == "450000000000.0 5e-06 None"


def test_click_types_report_a_usage_error() -> None:
    result = CliRunner().invoke(_cmd, ["--bw", "450"])
    assert result.exit_code == 2
    assert "Invalid value for '--bw'" in result.output
    assert "bandwidth '450' has no unit" in result.output
