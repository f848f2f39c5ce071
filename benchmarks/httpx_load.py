"""httpx as the load generator (``--load-generator httpx``, and the small modes where ``wrk`` is
not installed: they never install it): the same figures as :func:`benchmarks.wrk_load.run_wrk`,
from asyncio clients in this process, which take a share of the cores the server needs (so the
rates are lower than wrk's)."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import numpy as np


async def _load(
    url: str,
    body: bytes,
    content_type: str,
    clients: int,
    seconds: float,
    requests: int | None,
    warmup: float,
) -> tuple[list[float], int, float]:
    """(latencies of the 2xx answers, count of the others, wall seconds) of the measured phase,
    after ``warmup`` seconds of the same load on the same connections."""
    latencies: list[float] = []
    errors = issued = 0
    total = math.inf if requests is None else requests
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"content-type": content_type}
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:

        async def worker(deadline: float) -> None:
            nonlocal errors, issued
            while issued < total and time.perf_counter() < deadline:
                issued += 1
                start = time.perf_counter()
                response = await client.post(url, content=body, headers=headers)
                if response.is_success:
                    latencies.append(time.perf_counter() - start)
                else:
                    errors += 1

        if warmup > 0:  # connections opened, the server's batcher running
            warm = time.perf_counter() + warmup
            await asyncio.gather(*(worker(warm) for _ in range(clients)))
            latencies.clear()
            errors = issued = 0
        started = time.perf_counter()
        await asyncio.gather(*(worker(started + seconds) for _ in range(clients)))
        wall = time.perf_counter() - started
    return latencies, errors, wall


def run_httpx(
    url: str,
    body: bytes,
    content_type: str,
    *,
    clients: int,
    seconds: float,
    requests: int | None = None,
    warmup: float = 0.0,
) -> dict[str, float]:
    """``clients`` keep-alive httpx clients POSTing ``body`` to ``url`` for ``seconds``, or until
    ``requests`` are sent, after ``warmup`` unmeasured seconds: requests/s, requests, p50/p99
    latency (ms), non-2xx answers (socket errors raise)."""
    load = _load(url, body, content_type, clients, seconds, requests, warmup)
    latencies, errors, wall = asyncio.run(load)
    if not latencies:
        raise SystemExit(f"no successful requests to {url} ({errors} errors)")
    p50, p99 = np.percentile(np.asarray(latencies) * 1000, [50, 99])
    return {
        "rate": len(latencies) / wall,
        "requests": float(len(latencies)),
        "p50": float(p50),
        "p99": float(p99),
        "errors": float(errors),
        "socket_errors": 0.0,
    }
