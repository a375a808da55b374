import pytest

from kvtier.core.errors import UsageError
from kvtier.core.units import format_bytes, format_decimal, parse_size


@pytest.mark.parametrize(
    ("text", "expected", "unit"),
    [
        ("80GB", 80 * 10**9, "GB"),
        ("16GiB", 16 * 2**30, "GiB"),
        ("55.54e9", 55_540_000_000, ""),  # exact: not the float nearest 55.54e9
        ("1.5KiB", 1536, "KiB"),
        ("4TB", 4 * 10**12, "TB"),
        ("7 gb", 7 * 10**9, "GB"),
        ("100B", 100, "B"),
        ("0", 0, ""),
        ("2.5", 2, ""),  # fractional bytes round down
    ],
)
def test_parse(text, expected, unit):
    size = parse_size(text)
    assert size.bytes == expected
    assert size.unit == unit


def test_explain_says_which_unit_was_meant():
    assert parse_size("80GB").explain() == "80,000,000,000 B (GB = 10^9 B)"
    assert parse_size("16GiB").explain() == "17,179,869,184 B (GiB = 2^30 B)"
    assert parse_size("55.54e9").explain() == "55,540,000,000 B (no unit: bytes)"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("16G", "ambiguous; write GB \\(10\\^9 B\\) or GiB \\(2\\^30 B\\)"),
        ("-1GB", "negative"),
        ("abc", "cannot read"),
        ("", "cannot read"),
        ("1e30000GB", "too large"),
        ("12 parsecs", "unknown unit"),
        ("nan", "cannot read"),
    ],
)
def test_bad_sizes(text, message):
    with pytest.raises(UsageError, match=message):
        parse_size(text, "--dram")


def test_error_names_the_flag():
    with pytest.raises(UsageError, match=r"^--gpu-mem: "):
        parse_size("lots", "--gpu-mem")


def test_format():
    assert format_bytes(2 * 2**20) == "2 MiB"
    assert format_bytes(131072) == "128 KiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(100) == "100 B"
    assert format_bytes(-2048) == "-2 KiB"
    assert format_decimal(80e9) == "80 GB"
