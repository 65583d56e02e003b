"""Argument types and input files every ``kvbridge`` command reads alike."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from kvbridge.cli_errors import CliError
from kvbridge.core.errors import KvbridgeError
from kvbridge.core.layout import Layout


def read_json(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise CliError(f"cannot read {what} {str(path)!r}: {err.strerror}") from None


def read_layout(path: Path, what: str) -> Layout:
    try:
        return Layout.from_json(read_json(path, what))
    except KvbridgeError as err:
        raise CliError(f"{what} {str(path)!r}: {err}") from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value
