"""hpcdl.units.parse_bytes, the one byte-size parser (CLI, simulator, DLIO plugin), and its
argparse form: a bad size is a usage error that says why."""

import argparse

import pytest

from hpcdl.units import parse_bytes, size_type


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512M", 512 << 20),
        ("2G", 2 << 30),
        ("4KiB", 4096),
        ("1kb", 1024),
        (" 3T ", 3 << 40),
        ("1048576", 1048576),
        ("1e9", 10**9),
        ("1.5K", 1536),
        (4096, 4096),
    ],
)
def test_sizes_people_write(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text, message", [("12Q", "not a size"), ("", "not a size"), ("-1M", "must be positive"), ("0", "must be positive")]
)
def test_bad_sizes_say_why(text, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(text)


def test_zero_only_when_allowed():
    assert parse_bytes("0", allow_zero=True) == 0
    with pytest.raises(ValueError, match="must not be negative"):
        parse_bytes("-1", allow_zero=True)


def test_argparse_usage_error_carries_the_reason(capsys):
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--size", type=size_type())
    assert parser.parse_args(["--size", "2M"]).size == 2 << 20
    with pytest.raises(SystemExit):
        parser.parse_args(["--size", "2X"])
    assert "argument --size: not a size: '2X'" in capsys.readouterr().err
