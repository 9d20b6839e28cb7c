"""The command line of every benchmark: ``--help`` prints the module docstring as written and
each option's default next to its help."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def _worth_showing(default: Any) -> bool:
    # False, None and "" are what an unset flag or option means: nothing to add.  (Tested by
    # identity: a default of 0 is a value worth showing, and 0 == False.)
    return not (default is None or default is False or default == "" or default is argparse.SUPPRESS)


class BenchParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose options say their defaults in ``--help``."""

    def __init__(self, description: str | None) -> None:
        super().__init__(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        text = kwargs.get("help") or ""
        is_option = bool(names) and str(names[0]).startswith("-")
        if is_option and _worth_showing(kwargs.get("default")) and "%(default)" not in text:
            kwargs["help"] = f"{text} (default: %(default)s)".lstrip()
        return super().add_argument(*names, **kwargs)


def whole_number_from(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for a whole number >= ``minimum`` (refused in one line)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not >= {minimum}")
        return value

    return parse


#: an argparse ``type`` for counts (rounds, objects, runs): a whole number >= 1, since a
#: median of no rounds or a rate over no objects is not a figure
at_least_one = whole_number_from(1)


def dimensions(text: str) -> tuple[int, ...]:
    """An argparse ``type`` for a tensor shape given as ``2,8,256,1024``: whole numbers >= 1,
    since a zero or negative dimension is no tensor to measure."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(
            f"shape {text!r} is not whole numbers separated by commas (e.g. 2,8,256,1024)"
        )
    if any(int(part) < 1 for part in parts):
        raise argparse.ArgumentTypeError(f"shape {text!r}: every dimension must be >= 1")
    return tuple(int(part) for part in parts)
