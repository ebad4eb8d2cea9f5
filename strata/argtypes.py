"""argparse types for the CLI's numeric flags: a bad value is a usage error naming the flag and
the range (exit 2) before any work starts, not a traceback from deep inside a run."""
from __future__ import annotations

import argparse


def integer(lo: int | None = None, hi: int | None = None):
    """An int type bounded to [lo, hi] (either end open when None)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            want = (f"in {lo}..{hi}" if lo is not None and hi is not None
                    else f"≥ {lo}" if lo is not None else f"≤ {hi}")
            raise argparse.ArgumentTypeError(f"must be {want}, got {v}")
        return v
    parse.__name__ = "integer"  # (argparse names the type in its messages)
    return parse


COUNT = integer(1)            # how many of something: at least one
NONNEGATIVE = integer(0)
SEED = integer(0, 2 ** 63 - 1)
PORT = integer(0, 65535)
THREADS = integer(1, 1024)    # a thread pool's size


def count_or_auto(text: str) -> int | str:
    """COUNT, or the word "auto" (the command measures what fits: e.g. --prefill-chunk)."""
    if text == "auto":
        return text
    try:
        return COUNT(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or 'auto')") from None
