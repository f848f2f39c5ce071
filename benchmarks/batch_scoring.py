"""Batch-scoring throughput: `lapguard score` on the 10,000 Fashion-MNIST test images, in process and
through --url, against the in-process Guard at the same batch size, in one run.

    python -m benchmarks.batch_scoring [--bundle runs/quick/bundle] [--fallback-bundle DIR]
    python -m benchmarks.batch_scoring --bundle BUNDLE --small   # 256 images, once (the tests)

Prints:
  * in-process Guard throughput (``Guard.predict`` on the prepared test set, batch --batch-size),
    at torch's default thread count and at the count `lapguard score` leaves its main process
    (CPU cores - --workers); the faster one is the reference;
  * `lapguard score --bundle B --dataset fashion-mnist` (run in this process through the CLI's
    main; its summary's throughput covers reading, preparing, scoring and writing the rows) and
    its ratio to the reference (target >= 0.9);
  * the same through `--url` against `lapguard serve` started on 127.0.0.1 (a free port), and its
    ratio; and whether both outputs agree.

Each figure is the best of --repeat runs; the reference and the in-process `score` runs
alternate, so that the machine's drift touches both alike. Bounded: the server must be ready within 120 s, every
request times out after 60 s, and the server is stopped (SIGTERM, then kill) whatever happens.
Benchmark alone: other jobs on the cores skew everything.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import small
from benchmarks.local_server import ROOT, Server, start_server, stop_server
from detector.guard import Guard
from training.cli.main import main as cli_main
from training.data.datasets import default_root, load_dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=ROOT / "runs" / "quick" / "bundle")
    p.add_argument(
        "--fallback-bundle", type=Path, default=None, help="used when --bundle does not exist"
    )
    p.add_argument("--root", type=Path, default=None, help="data root (default $LAPGUARD_DATA)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="data-loading processes of the local run")
    p.add_argument("--url-batch-size", type=int, default=64, help="images per request with --url")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight with --url")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--n", type=int, default=None, help="only the first N test images")
    p.add_argument(
        "--small",
        action="store_true",
        help="seconds: 256 images, batch 64, once, no loader processes, 1 torch thread, the "
        "server in a thread of this process",
    )
    return small.parse(
        p, argv, n=256, batch_size=64, url_batch_size=32, repeat=1, workers=0, one_torch_thread=True
    )


def guard_throughput(guard: Guard, x: torch.Tensor, batch_size: int, repeat: int) -> float:
    """Images/s of ``guard.predict`` over ``x`` in batches (best of ``repeat`` passes)."""
    guard.predict(x[:batch_size])  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for i in range(0, len(x), batch_size):
            guard.predict(x[i : i + batch_size])
        best = min(best, time.perf_counter() - start)
    return len(x) / best


def run_score(argv: list[str], out: Path) -> tuple[float, str]:
    """`lapguard score ARGV --out OUT` in this process; (its throughput, its summary)."""
    out.unlink(missing_ok=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli_main(["score", *argv, "--out", str(out), "--no-progress"])
    summary = printed.getvalue()
    if status != 0:
        raise SystemExit(f"lapguard score failed ({status}): {summary}")
    match = re.search(r"([\d.]+) images/s", summary)
    if match is None:
        raise SystemExit(f"no throughput in the summary: {summary}")
    return float(match.group(1)), summary.strip()


def start_local_server(args: argparse.Namespace, bundle: Path) -> tuple[Server, str]:
    env = {
        "LAPGUARD_MAX_IMAGES_PER_REQUEST": str(args.url_batch_size),
        "LAPGUARD_MAX_QUEUE": str(max(512, 2 * args.concurrency * args.url_batch_size)),
    }
    flags = ["--device", args.device, "--max-batch-size", str(args.batch_size)]
    return start_server(bundle, flags=flags, env=env, in_process=args.small)


def disagreements(a: Path, b: Path) -> tuple[int, float]:
    """(rows whose label or flag differ, largest score difference) between two outputs."""
    rows_a = [json.loads(line) for line in a.read_text().splitlines()]
    rows_b = [json.loads(line) for line in b.read_text().splitlines()]
    if [r["index"] for r in rows_a] != [r["index"] for r in rows_b]:
        return max(len(rows_a), len(rows_b)), float("inf")
    differ = sum(
        (r["label"], r["flagged"]) != (s["label"], s["flagged"])
        for r, s in zip(rows_a, rows_b, strict=True)
    )
    gap = max(abs(r["score"] - s["score"]) for r, s in zip(rows_a, rows_b, strict=True))
    return differ, gap


def served_score(
    args: argparse.Namespace, bundle: Path, common: list[str], out: Path
) -> tuple[float, str]:
    """`lapguard score --url` against a server of ``bundle``: (the best throughput of
    ``--repeat`` runs, its summary)."""
    process, url = start_local_server(args, bundle)
    try:
        url_argv = [
            "--url", url, *common, "--batch-size", str(args.url_batch_size),
            "--concurrency", str(args.concurrency), "--timeout", "60",
        ]  # fmt: skip
        return max(run_score(url_argv, out) for _ in range(args.repeat))
    finally:
        stop_server(process)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bundle = args.bundle
    if not (bundle / "manifest.json").is_file():
        if args.fallback_bundle is None or not (args.fallback_bundle / "manifest.json").is_file():
            raise SystemExit(f"no bundle at {bundle}; build one or pass --fallback-bundle DIR")
        print(f"{bundle} does not exist: using the fallback bundle")
        bundle = args.fallback_bundle
    root = args.root or default_root()
    guard = Guard.from_bundle(bundle, device=args.device)
    name = guard.manifest.name if guard.manifest else "?"
    default_threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    scoring_threads = min(default_threads, max(1, cores - args.workers))
    print(
        f"bundle {bundle} ({name}) on {guard.device}; {cores} CPUs, torch threads {default_threads} "
        f"(`lapguard score` main process: {scoring_threads}); batch size {args.batch_size}"
    )

    test = load_dataset("fashion-mnist", "test", root=root)
    x = guard.prepare(np.asarray(test.data[: args.n]))  # the test images (--n), prepared once
    common = ["--dataset", "fashion-mnist", "--root", str(root)]
    common += ["--n", str(args.n)] if args.n else []
    with tempfile.TemporaryDirectory(prefix="batch-scoring-") as tmp:
        local_out, remote_out = Path(tmp) / "local.jsonl", Path(tmp) / "remote.jsonl"
        local_argv = [
            "--bundle", str(bundle), *common, "--batch-size", str(args.batch_size),
            "--workers", str(args.workers), "--device", args.device,
        ]  # fmt: skip
        # Reference and `lapguard score` alternate, so that a drift of the machine's speed over
        # the run (large on shared cores) touches both sides of the ratio alike.
        rates: dict[int, list[float]] = {}
        local: list[tuple[float, str]] = []
        for _ in range(args.repeat):
            for threads in sorted({default_threads, scoring_threads}):
                torch.set_num_threads(threads)
                rates.setdefault(threads, []).append(guard_throughput(guard, x, args.batch_size, 1))
            torch.set_num_threads(default_threads)
            local.append(run_score(local_argv, local_out))
        for threads, measured in rates.items():
            print(f"  in-process Guard.predict, {threads} thread(s): {max(measured):9.1f} images/s")
        reference = max(max(measured) for measured in rates.values())
        print(f"reference (in-process Guard, batch {args.batch_size}): {reference:.1f} images/s")
        local_rate, local_summary = max(local)
        print(
            f"`lapguard score` in process (best of {args.repeat}, alternating with the reference):"
        )
        print("  " + local_summary.replace("\n", "\n  "))
        print(
            f"lapguard score / in-process Guard: {local_rate / reference:.2f}  target >= 0.9  "
            f"({local_rate:.1f} vs {reference:.1f} images/s)"
        )
        del guard

        remote_rate, remote_summary = served_score(args, bundle, common, remote_out)
        print(
            f"`lapguard score --url` against `lapguard serve` on 127.0.0.1 "
            f"({args.url_batch_size} images/request, concurrency {args.concurrency}, best of {args.repeat}):"
        )
        print("  " + remote_summary.replace("\n", "\n  "))
        print(
            f"lapguard score --url / in-process Guard: {remote_rate / reference:.2f} "
            f"({remote_rate:.1f} vs {reference:.1f} images/s)"
        )
        differ, gap = disagreements(local_out, remote_out)
        print(
            f"in-process vs --url rows: {differ} differ in label or flag; largest score gap {gap:.2g}"
        )


if __name__ == "__main__":
    main()
