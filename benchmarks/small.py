"""The benchmarks' ``--small`` mode (seconds on tiny inputs, what tests/test_benchmarks.py runs),
one way: each benchmark declares the flag itself, with a help text that says what its small mode
does, and parses its arguments with :func:`parse`, giving the values the small mode sets."""

from __future__ import annotations

import argparse
import shutil
from typing import Any


def parse(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    /,
    *,
    one_torch_thread: bool = False,
    **small: Any,
) -> argparse.Namespace:
    """``parser``'s arguments from ``argv``; under ``--small``, each of ``small`` set on them in
    order (a callable is called with the arguments set so far, and what it returns is set), then,
    with ``one_torch_thread``, torch in this process on one thread."""
    args = parser.parse_args(argv)
    if args.small:
        for name, value in small.items():
            setattr(args, name, value(args) if callable(value) else value)
        if one_torch_thread:
            import torch  # here: a benchmark that never sets threads does not load torch for it

            torch.set_num_threads(1)
    return args


def threads_or_one(args: argparse.Namespace) -> int:
    """``--threads`` as given, else one: two torch threads on two busy cores can stall 30x in
    OpenMP's barriers."""
    return args.threads or 1


def httpx_unless_wrk(args: argparse.Namespace) -> str:
    """``--load-generator`` as given where ``wrk`` is installed, else httpx: a small mode never
    installs wrk."""
    return args.load_generator if shutil.which("wrk") else "httpx"
