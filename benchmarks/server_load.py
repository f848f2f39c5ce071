"""What the benchmarks that load `lapguard serve` over HTTP share: the flags of
:mod:`benchmarks.service_throughput` and :mod:`benchmarks.cluster_throughput` (the load generator's
in :mod:`benchmarks.service_peers` too), and the load generator they choose, ``wrk``
(:mod:`benchmarks.wrk_load`, installed when missing) or httpx in this process
(:mod:`benchmarks.httpx_load`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.wrk_load import ensure_wrk


def add_load_generator_flag(p: argparse.ArgumentParser, *, servers: str) -> None:
    """``--load-generator``: wrk (the default) or httpx, which shares the cores of ``servers``."""
    p.add_argument(
        "--load-generator",
        choices=["wrk", "httpx"],
        default="wrk",
        help=f"wrk (installed when missing) or httpx in this process (takes a core from {servers})",
    )


def add_server_load_flags(
    p: argparse.ArgumentParser, *, device: str, warmup: float, servers: str
) -> None:
    """The bundle ``servers`` serve on ``device``, their micro-batch size, the concurrent
    single-image clients, the seconds of load before measuring and the load generator."""
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--device", default=device)
    p.add_argument("--max-batch-size", type=int, default=64, help=f"micro-batch size of {servers}")
    p.add_argument("--clients", type=int, default=32, help="concurrent single-image clients")
    p.add_argument("--warmup", type=float, default=warmup, help="seconds of load before measuring")
    add_load_generator_flag(p, servers=servers)


def ensure_load_generator(args: argparse.Namespace, *, servers: str) -> None:
    """Installs wrk when it is the load generator; otherwise, in the small mode, says that httpx
    loads ``servers`` instead."""
    if args.load_generator == "wrk":
        ensure_wrk()
    elif args.small:
        print(f"wrk is not installed: the small mode loads {servers} with httpx instead")
