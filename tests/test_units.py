import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.errors import UsageError
from kvtier.core.units import exact_size, format_bytes, format_decimal, parse_bytes, parse_size


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
        ("4096.5", 4096, ""),  # fractional bytes round down
        ("80B", 80, "B"),  # a small size needs its unit
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
        ("80", "80 without a unit would be 80 bytes.*write the unit \\(80GiB, 80GB"),
        ("2.5", "without a unit"),
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


def test_parse_bytes_takes_whole_numbers_and_text():
    assert parse_bytes(4096) == 4096 and parse_bytes("4KiB") == 4096 and parse_bytes(0) == 0
    for bad, message in ((True, "expected a size"), (1.5, "expected a size"), (-1, "negative"),
                         (80, "80 without a unit"), ("1.5g", "ambiguous")):
        with pytest.raises(UsageError, match=message):
            parse_bytes(bad, "x")


def test_exact_size_is_short_and_exact():
    assert exact_size(64 * 2**30) == "64GiB"
    assert exact_size(3840 * 10**9) == "3840GB"
    assert exact_size(16 * 2**10) == "16KiB"
    assert exact_size(4097) == "4097B"
    assert exact_size(0) == "0"


@given(st.integers(min_value=0, max_value=2**63))
def test_exact_size_round_trips(n):
    assert parse_bytes(exact_size(n)) == n
