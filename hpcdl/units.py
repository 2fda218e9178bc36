"""Sizes as people write them: the one byte-size parser of the command line,
the simulator, the DLIO plugin's environment variables and the benchmarks."""

import argparse

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text, allow_zero=False):
    """'512M', '2G', '4KiB', '1048576', '1e9' -> bytes (int; K, M, G, T are powers of 1024).
    ValueError for text that is not a size, a negative size, or 0 unless allow_zero."""
    text = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    scale = _UNITS.get(text[-1:], 1)
    try:
        value = float(text[:-1] if text[-1:] in _UNITS else text) * scale
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 512M, 2G)") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError("size must be positive" if not allow_zero else "size must not be negative")
    return int(value)


def _argparse_type(parse):
    """parse(text) as an argparse ``type=``: its ValueError's message becomes the usage error."""

    def parse_argument(text):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_argument


def size_type(allow_zero=False):
    """parse_bytes as an argparse ``type=``."""
    return _argparse_type(lambda text: parse_bytes(text, allow_zero))


def positive_int(value, name):
    """A count that must be at least 1 (shards, threads), as an int; ValueError naming it otherwise."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def positive_int_type(name):
    """positive_int as an argparse ``type=``."""
    return _argparse_type(lambda text: positive_int(text, name))


AUTO = "auto"


def _is_auto(value):
    return isinstance(value, str) and value.strip().lower() == AUTO


def count_or_auto(value, name):
    """A setting that is a count or "auto": None for "auto", else a non-negative
    int or its decimal text (0 allowed). ValueError naming the setting for anything else."""
    if _is_auto(value):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < 0:
        raise ValueError(f"{name} must be a non-negative integer or {AUTO!r}, got {value!r}")
    return int(value)


def size_or_auto(value, name):
    """A setting that is a byte size or "auto": None for "auto", else the size
    (a non-negative int, or text parse_bytes reads, 0 allowed). ValueError
    naming the setting for anything else (a negative size, a bool, garbage)."""
    if _is_auto(value):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)) and not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be a non-negative size or {AUTO!r}, got {value!r}")
    if not isinstance(value, str):
        if int(value) < 0:
            raise ValueError(f"{name} must be a non-negative size or {AUTO!r}, got {value!r}")
        return int(value)
    try:
        return parse_bytes(value, allow_zero=True)
    except ValueError as exc:
        raise ValueError(f"{name} must be a non-negative size or {AUTO!r}, got {value!r} ({exc})") from None
