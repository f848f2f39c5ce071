"""Soak: a real server under a steady mix of valid, invalid and oversized requests for minutes,
then a graceful stop (SIGTERM) while the clients are still sending.

    python -m benchmarks.soak --bundle runs/q12/bundle [--minutes 10] [--clients 32] [--out DIR]
    python -m benchmarks.soak --bundle BUNDLE --out DIR --small   # 6 s, 4 clients (the tests)

A benchmark, not a test: it reports, it does not assert. `lapguard serve` runs in a subprocess on
127.0.0.1 (:mod:`benchmarks.local_server`); ``--clients`` keep-alive connections each send one
request after another, drawn from a seeded mix (:data:`MIX`): single-image PNG multipart
``POST /v1/predict`` (most), JSON base64, Open Inference Protocol BYTES, and requests that must be
refused: a corrupt PNG (400), a text part (415), a 0-byte file (400), bad JSON (422) and a body
over the server's ``--max-body-bytes`` (413), declared up front or streamed in chunks.

Every ``--window`` seconds it prints one row: the window's counts by status, p50/p99 latency of
the valid requests, and the server's RSS (``/proc/PID/status`` VmRSS) and open file descriptors
(``/proc/PID/fd``). At the end it sends SIGTERM while the clients keep sending, and accounts for
every request in flight at that moment: a request *accepted* before the stop (its whole body sent
before the SIGTERM) must end with a response (200, or 503 while draining); one that ends with the
connection closed or a timeout instead is *lost*. Requests begun after the SIGTERM are counted
apart: 503, refused, or closed unanswered when uvicorn's shutdown closes the connection they were
sent on (an idle keep-alive one, or a new one not yet read): the race of any close of a
listener or a keep-alive connection, not a request the server had accepted. Then it prints the final table and writes
``soak.json`` and ``soak.png`` (latency and RSS over time) under ``--out``.

The load generator is a minimal asyncio HTTP/1.1 client (uvloop when installed) in this process,
separate from the server: it must see, per request, whether the body was sent before the stop and
how the connection ended, which ``wrk`` cannot tell. It takes part of the 2 cores, so the rates
here are not peak rates (see :mod:`benchmarks.service_throughput` for those); this measures correctness over
time. Everything is bounded in time; Ctrl-C stops the server. ``--small`` (the tests) serves in a
thread of this process (its RSS and fds are then this process's; SIGTERM is the server's own
graceful exit) for 6 seconds of 4 clients: the accounting, not the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import io
import json
import math
import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from benchmarks import small
from benchmarks.local_server import Server, start_server, stop_server

#: Kind of request -> (share of the requests, expected statuses). 503 is also expected of any
#: request once the stop has begun (the documented draining answer).
MIX: dict[str, tuple[float, frozenset[int]]] = {
    "png": (0.69, frozenset({200})),
    "json_b64": (0.08, frozenset({200})),
    "v2_bytes": (0.07, frozenset({200})),
    "corrupt_png": (0.04, frozenset({400})),
    "wrong_type": (0.03, frozenset({415})),
    "empty_file": (0.03, frozenset({400})),
    "bad_json": (0.03, frozenset({422})),
    "oversized": (0.02, frozenset({413})),
    "oversized_chunked": (0.01, frozenset({413})),
}
VALID = ("png", "json_b64", "v2_bytes")
#: How a request ended when no status came back.
REFUSED, CLOSED, WRITE_FAILED, TIMEOUT = "refused", "closed", "write_failed", "timeout"
BOUNDARY = "lapguard-soak-boundary"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=10.0, help="load duration before the stop")
    p.add_argument("--clients", type=int, default=32, help="concurrent keep-alive clients")
    p.add_argument("--window", type=float, default=30.0, help="seconds per sample row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=2 << 20,
        help="the server's body limit (413 above); over 1 MiB, so that a chunked upload's file "
        "part is spooled to disk before the limit refuses it",
    )
    p.add_argument("--request-timeout", type=float, default=30.0, help="seconds per request")
    p.add_argument("--out", type=Path, default=Path("runs/soak"), help="soak.json and soak.png")
    p.add_argument(
        "--small",
        action="store_true",
        help="seconds: 6 s of 4 clients, 2 s windows, the server in a thread of this process",
    )
    return small.parse(p, argv, minutes=0.1, clients=4, window=2.0)


# ---- requests -------------------------------------------------------------------------------
def sample_pngs(shape: tuple[int, int, int], n: int, seed: int) -> list[bytes]:
    """Seeded noise images in the bundle's input shape, PNG-encoded."""
    channels, height, width = shape
    rng = np.random.default_rng(seed)
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[channels]
    pngs = []
    for _ in range(n):
        pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode).save(buffer, "PNG")
        pngs.append(buffer.getvalue())
    return pngs


def http_request(path: str, content_type: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def chunked_request(path: str, content_type: str, body: bytes, chunk: int = 65536) -> bytes:
    """A request whose body is sent in chunks (no Content-Length: the limit applies as it
    streams in, and a file part over 1 MiB is spooled to disk by then)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    parts = [
        f"{len(body[i : i + chunk]):x}\r\n".encode() + body[i : i + chunk] + b"\r\n"
        for i in range(0, len(body), chunk)
    ]
    return head.encode() + b"".join(parts) + b"0\r\n\r\n"


def multipart(blob: bytes, part_type: str = "image/png") -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="files"; filename="x.png"\r\n'
        f"Content-Type: {part_type}\r\n\r\n".encode()
        + blob
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


def build_requests(pngs: list[bytes], model: str, max_body: int) -> dict[str, list[bytes]]:
    """Raw HTTP/1.1 requests of each kind of :data:`MIX` (a few variants each)."""
    form = f"multipart/form-data; boundary={BOUNDARY}"
    b64 = [base64.b64encode(png).decode() for png in pngs]
    v2 = f"/v2/models/{model}/infer"
    corrupt = [png[: len(png) // 2] + bytes(16) for png in pngs[:4]]
    return {
        "png": [http_request("/v1/predict", form, multipart(png)) for png in pngs],
        "json_b64": [
            http_request(
                "/v1/predict", "application/json", json.dumps({"instances": [{"b64": b}]}).encode()
            )
            for b in b64
        ],  # fmt: skip
        "v2_bytes": [
            http_request(
                v2,
                "application/json",
                json.dumps(
                    {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [b]}]}
                ).encode(),
            )
            for b in b64
        ],  # fmt: skip
        "corrupt_png": [http_request("/v1/predict", form, multipart(c)) for c in corrupt],
        "wrong_type": [http_request("/v1/predict", form, multipart(b"hello", "text/plain"))],
        "empty_file": [http_request("/v1/predict", form, multipart(b""))],
        "bad_json": [http_request("/v1/predict", "application/json", b'{"instances": [{"b64": ')],
        "oversized": [http_request("/v1/predict", form, multipart(bytes(max_body + 1024)))],
        "oversized_chunked": [
            chunked_request("/v1/predict", form, multipart(bytes(max_body + 1024)))
        ],
    }


# ---- the load generator ---------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class Record:
    """One request: when it began, when its whole body was handed to the kernel (nan: never),
    when it ended, its status (0: no response; then ``outcome`` says how it ended) and the
    status of the previous response on its connection (0: a new connection)."""

    kind: str
    begin: float
    sent: float
    end: float
    status: int = 0
    outcome: str = ""
    previous: int = 0


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """(status, whether the server closes the connection) of one HTTP/1.1 response."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = dict(
        (name.strip().lower(), value.strip())
        for name, value in (line.split(":", 1) for line in head[1:] if ":" in line)
    )
    if "content-length" in headers:
        await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            await reader.readexactly(size + 2)
        await reader.readuntil(b"\r\n")
    return status, headers.get("connection", "").lower() == "close"


class Client:
    """One keep-alive connection that sends requests one after another (reconnecting when the
    server closes it). The response is read while the body is written, as curl does: a server
    may answer (413) before it has read the body."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._previous = 0  # status of the last response on this connection

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
        self._previous = 0

    async def send(self, kind: str, raw: bytes) -> Record:
        record = Record(kind, time.monotonic(), math.nan, math.nan, previous=self._previous)
        try:
            await asyncio.wait_for(self._exchange(record, raw), self.timeout)
        except asyncio.TimeoutError:
            record.outcome = TIMEOUT
            self.close()
        record.end = time.monotonic()
        return record

    async def _exchange(self, record: Record, raw: bytes) -> None:
        if self._writer is None:
            try:
                self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                record.outcome = REFUSED
                return
        assert self._reader is not None and self._writer is not None
        response = asyncio.ensure_future(read_response(self._reader))
        try:
            self._writer.write(raw)
            if self._writer.transport.get_write_buffer_size():
                await self._writer.drain()
            record.sent = time.monotonic()
        except OSError:
            pass  # the server may have answered and closed: read what it sent
        try:
            record.status, closing = await response
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            record.outcome = WRITE_FAILED if math.isnan(record.sent) else CLOSED
            self.close()
            return
        finally:
            response.cancel()
        self._previous = record.status
        if closing or math.isnan(record.sent):
            self.close()


@dataclasses.dataclass
class LoadState:
    sending: bool = True


async def run_client(
    index: int,
    plan: dict[str, list[bytes]],
    url: str,
    args: argparse.Namespace,
    state: LoadState,
    records: list[Record],
) -> None:
    """One client: seeded draws from :data:`MIX` until told to stop."""
    rng = random.Random(args.seed * 10_007 + index)
    kinds, weights = list(MIX), [share for share, _ in MIX.values()]
    host, port = url.removeprefix("http://").split(":")
    client = Client(host, int(port), args.request_timeout)
    try:
        while state.sending:
            kind = rng.choices(kinds, weights)[0]
            record = await client.send(kind, rng.choice(plan[kind]))
            records.append(record)
            if record.outcome == REFUSED:
                await asyncio.sleep(0.05)
    finally:
        client.close()


# ---- sampling -------------------------------------------------------------------------------
def label(record: Record) -> str:
    """The status code, or how the request ended without one."""
    return str(record.status) if record.status else record.outcome


@dataclasses.dataclass
class Sample:
    """The server process (RSS, open fds, CPU seconds) and this one (CPU seconds) at ``at``."""

    at: float
    rss_mib: float
    fds: int
    server_cpu: float
    generator_cpu: float


def sample(pid: int) -> Sample:
    """Read ``/proc/PID/status`` (VmRSS), ``/proc/PID/fd`` and ``/proc/PID/stat`` (CPU)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(
        int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")
    )
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(stat[11]) + int(stat[12])  # utime + stime (fields 14 and 15 of stat)
    return Sample(
        at=time.monotonic(),
        rss_mib=rss_kib / 1024,
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        server_cpu=ticks / os.sysconf("SC_CLK_TCK"),
        generator_cpu=time.process_time(),
    )


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def window_row(done: list[Record], before: Sample, now: Sample, t0: float) -> dict:
    """What the requests that ended between two samples saw, and the server at the second;
    CPU in % of one core, of the server and of this load generator."""
    latencies = [1000 * (r.end - r.begin) for r in done if r.kind in VALID and r.status == 200]
    seconds = max(now.at - before.at, 1e-9)
    return {
        "minute": round((now.at - t0) / 60, 3),
        "requests": len(done),
        "per_second": round(len(done) / seconds, 1),
        "codes": dict(sorted(Counter(label(r) for r in done).items())),
        "p50_ms": round(percentile(latencies, 50), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "rss_mib": round(now.rss_mib, 1),
        "fds": now.fds,
        "server_cpu_pct": round(100 * (now.server_cpu - before.server_cpu) / seconds),
        "generator_cpu_pct": round(100 * (now.generator_cpu - before.generator_cpu) / seconds),
    }


COLUMNS = ("200", "400", "413", "415", "422")


def print_row(row: dict | None) -> None:
    """One progress line (the header when ``row`` is None)."""
    if row is None:
        cells = ["min", "req/s", *COLUMNS, "5xx", "none", "p50 ms", "p99 ms", "RSS MiB", "fds"]
        cells += ["srv CPU%", "gen CPU%"]
        print("".join(f"{c:>9}" for c in cells), flush=True)
        return
    codes = row["codes"]
    fivexx = sum(n for code, n in codes.items() if code.startswith("5"))
    none = sum(n for code, n in codes.items() if not code.isdigit())
    values = [row["minute"], row["per_second"], *(codes.get(c, 0) for c in COLUMNS), fivexx, none]
    values += [row["p50_ms"], row["p99_ms"], row["rss_mib"], row["fds"]]
    values += [row["server_cpu_pct"], row["generator_cpu_pct"]]
    print("".join(f"{v:>9}" for v in values), flush=True)


# ---- the run --------------------------------------------------------------------------------
async def soak(
    args: argparse.Namespace, process: Server, url: str, plan: dict[str, list[bytes]]
) -> dict:
    """Load for ``--minutes`` with a row every ``--window`` s, then the graceful stop."""
    idle = sample(process.pid)
    state, records = LoadState(), []
    tasks = [
        asyncio.create_task(run_client(i, plan, url, args, state, records))
        for i in range(args.clients)
    ]
    t0 = before = sample(process.pid)
    end, taken, rows = t0.at + args.minutes * 60, 0, []
    print_row(None)
    try:
        while before.at < end:
            await asyncio.sleep(max(0.0, min(before.at + args.window, end) - time.monotonic()))
            now, n = sample(process.pid), len(records)
            rows.append(window_row(records[taken:n], before, now, t0.at))
            before, taken = now, n
            print_row(rows[-1])
        stop = await graceful_stop(process, state, tasks, args.request_timeout)
    finally:
        state.sending = False
        for task in tasks:
            task.cancel()
    stop["minute"] = round((stop["t_stop"] - t0.at) / 60, 3)
    return {
        "loop": type(asyncio.get_running_loop()).__module__,
        "idle": {"rss_mib": round(idle.rss_mib, 1), "fds": idle.fds},
        "windows": rows,
        "stop": stop,
        "records": records,
    }


async def graceful_stop(
    process: Server, state: LoadState, tasks: list[asyncio.Task], timeout: float
) -> dict:
    """SIGTERM while the clients keep sending; they stop once the server has exited."""
    t_stop = time.monotonic()
    process.send_signal(signal.SIGTERM)
    deadline = t_stop + GRACE_S + 15
    while process.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    exit_seconds = time.monotonic() - t_stop
    code = process.poll()
    if code is None:
        process.kill()
    state.sending = False
    _, pending = await asyncio.wait(tasks, timeout=timeout + 5)
    for task in pending:
        task.cancel()
    return {
        "t_stop": t_stop,
        "exit_code": code,
        "exit_seconds": round(exit_seconds, 2),
        "killed": code is None,
    }


#: The server's graceful timeout (its default, LAPGUARD_GRACEFUL_TIMEOUT_S).
GRACE_S = 20.0


# ---- the summary ----------------------------------------------------------------------------
def errors_by_kind(records: list[Record], t_stop: float) -> dict:
    """Per kind of request, before the stop: outcomes, and how many were not the expected one."""
    table = {}
    for kind, (_, expected) in MIX.items():
        done = [r for r in records if r.kind == kind and r.end < t_stop]
        codes = Counter(label(r) for r in done)
        table[kind] = {
            "requests": len(done),
            "codes": dict(sorted(codes.items())),
            "expected": sorted(expected),
            "unexpected": sum(n for c, n in codes.items() if not c.isdigit() or int(c) not in expected),
        }  # fmt: skip
    return table


def stop_accounting(records: list[Record], t_stop: float) -> dict:
    """How the requests in flight at the SIGTERM, and those begun after it, ended. Lost: whole
    body sent before the SIGTERM, then no response (connection closed, or a timeout)."""
    in_flight = [r for r in records if r.begin < t_stop <= r.end]
    accepted = [r for r in in_flight if r.sent < t_stop]  # nan (never sent) compares False
    after = [r for r in records if r.begin >= t_stop]
    return {
        "in_flight": len(in_flight),
        "accepted": len(accepted),
        "accepted_outcomes": dict(Counter(label(r) for r in accepted)),
        "still_sending_outcomes": dict(Counter(label(r) for r in in_flight if not r.sent < t_stop)),
        "lost": sum(1 for r in accepted if not r.status),
        "after_stop_outcomes": dict(Counter(label(r) for r in after)),
        "after_stop_unanswered_by_previous": dict(
            Counter(
                f"after {r.previous or 'a new connection'}"
                for r in after
                if not r.status and r.outcome != REFUSED
            )
        ),
        "unanswered_before_stop": sum(1 for r in records if r.end < t_stop and not r.status),
        "unexpected_5xx_after_stop": sum(1 for r in after if r.status >= 500 and r.status != 503),
    }


def resources(
    windows: list[dict], idle: dict, minutes: float, clients: int, per_client: int = 1
) -> dict:
    """RSS growth from minute 2 (or a fifth of a shorter run) to the end; fds against the
    ceiling of the idle count plus ``per_client`` sockets per client (2 when the server is a
    thread of this process: both ends of each connection are then this process's)."""
    from_minute = min(2.0, minutes / 5)
    base = next(w for w in windows if w["minute"] >= from_minute - 1e-6)
    last = windows[-1]
    return {
        "from_minute": base["minute"],
        "rss_start_mib": idle["rss_mib"],
        "rss_from_mib": base["rss_mib"],
        "rss_end_mib": last["rss_mib"],
        "rss_growth": round(last["rss_mib"] / base["rss_mib"] - 1, 4),
        "fds_idle": idle["fds"],
        "fds_from": base["fds"],
        "fds_end": last["fds"],
        "fds_max": max(w["fds"] for w in windows),
        "fds_ceiling": idle["fds"] + per_client * clients,
        "fds_per_client": per_client,
    }


def summarize(run: dict, args: argparse.Namespace) -> dict:
    records, t_stop = run["records"], run["stop"]["t_stop"]
    before = [r for r in records if r.end < t_stop]
    latencies = [1000 * (r.end - r.begin) for r in before if r.kind in VALID and r.status == 200]
    kinds = errors_by_kind(records, t_stop)
    stop = stop_accounting(records, t_stop)
    per_client = 2 if args.small else 1
    memory = resources(run["windows"], run["idle"], args.minutes, args.clients, per_client)
    fivexx = sum(1 for r in before if r.status >= 500) + stop["unexpected_5xx_after_stop"]
    done = {"no 5xx": fivexx == 0}
    if not args.small:
        done["RSS growth <= 10%"] = memory["rss_growth"] <= 0.10
        done["no fd growth"] = memory["fds_end"] <= memory["fds_ceiling"]
    done["0 lost on a graceful stop"] = stop["lost"] == 0 and not run["stop"]["killed"]
    summary = {
        "requests": len(before),
        "per_second": round(len(before) / (args.minutes * 60), 1),
        "p50_ms": round(percentile(latencies, 50), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "kinds": kinds,
        "unexpected": sum(k["unexpected"] for k in kinds.values()),
        "5xx": fivexx,
        "resources": memory,
        "graceful_stop": {**{k: v for k, v in run["stop"].items() if k != "t_stop"}, **stop},
        "done": done,
    }
    if args.small:  # RSS and fds are then this whole process's, over seconds: not judged
        summary["not judged"] = "RSS and fds: the server is a thread of this process"
    return summary


def print_summary(summary: dict) -> None:
    print(f"\n{summary['requests']} requests before the stop ({summary['per_second']}/s), "
          f"valid 200s p50 {summary['p50_ms']} ms, p99 {summary['p99_ms']} ms")  # fmt: skip
    print(f"\n{'kind':<18}{'requests':>9}  {'expected':<10}{'unexpected':>11}  codes")
    for kind, k in summary["kinds"].items():
        expected = "/".join(map(str, k["expected"]))
        codes = " ".join(f"{c}:{n}" for c, n in k["codes"].items())
        print(f"{kind:<18}{k['requests']:>9}  {expected:<10}{k['unexpected']:>11}  {codes}")
    r = summary["resources"]
    print(f"\nRSS: idle {r['rss_start_mib']} MiB, minute {r['from_minute']} {r['rss_from_mib']} MiB, "
          f"end {r['rss_end_mib']} MiB: growth {100 * r['rss_growth']:+.1f}%")  # fmt: skip
    print(f"fds: idle {r['fds_idle']}, minute {r['from_minute']} {r['fds_from']}, end "
          f"{r['fds_end']}, max {r['fds_max']} (ceiling idle + {r['fds_per_client']} per client "
          f"= {r['fds_ceiling']})")  # fmt: skip
    g = summary["graceful_stop"]
    print(f"\nSIGTERM at minute {g['minute']}: server exited in {g['exit_seconds']} s "
          f"(status {g['exit_code']}{', killed' if g['killed'] else ''}; -15 is uvicorn "
        "re-raising the SIGTERM after its graceful shutdown)")  # fmt: skip
    print(f"  in flight {g['in_flight']}, of which accepted (body sent before) {g['accepted']}: "
          f"{g['accepted_outcomes']}; still sending: {g['still_sending_outcomes']}")  # fmt: skip
    print(f"  LOST (accepted, then no response): {g['lost']}")
    print(f"  begun after the SIGTERM: {g['after_stop_outcomes']}")
    print(f"    unanswered, by the previous answer on their connection: "
          f"{g['after_stop_unanswered_by_previous']}")  # fmt: skip
    print(f"  unanswered before the stop: {g['unanswered_before_stop']}")
    print(
        "\n"
        + "\n".join(f"{'PASS' if ok else 'FAIL'}  {what}" for what, ok in summary["done"].items())
    )
    if "not judged" in summary:
        print(f"(not judged: {summary['not judged']})")


def plot(windows: list[dict], path: Path) -> None:
    """Latency p50/p99 of the valid requests, and the server's RSS and fds, over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [w["minute"] for w in windows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    top.plot(minutes, [w["p50_ms"] for w in windows], marker="o", label="p50")
    top.plot(minutes, [w["p99_ms"] for w in windows], marker="o", label="p99")
    top.set_ylabel("latency of valid requests (ms)")
    top.set_ylim(bottom=0)
    top.legend()
    bottom.plot(minutes, [w["rss_mib"] for w in windows], marker="o", color="C2")
    bottom.set_ylabel("server RSS (MiB)", color="C2")
    fds = bottom.twinx()
    fds.plot(minutes, [w["fds"] for w in windows], marker=".", color="C3")
    fds.set_ylabel("open fds", color="C3")
    bottom.set_xlabel("minutes under load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def machine_load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def run_soak(args: argparse.Namespace, process: Server, url: str) -> dict:
    """The load, the stop and the summary, on uvloop when it is installed."""
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    spec = manifest["input_spec"]
    shape = (spec["channels"], spec["height"], spec["width"])
    model = httpx.get(url + "/v1/model", timeout=10).json()["name"]
    plan = build_requests(sample_pngs(shape, 16, args.seed), model, args.max_body_bytes)
    try:
        import uvloop

        run = uvloop.run(soak(args, process, url, plan))
    except ImportError:
        run = asyncio.run(soak(args, process, url, plan))
    return {**{k: run[k] for k in ("loop", "idle", "windows")}, "summary": summarize(run, args)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Ctrl-C, and SIGTERM alike, raise KeyboardInterrupt: the server is stopped on the way out
    # (also when this runs in the background, where a shell starts SIGINT ignored).
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in handlers:
        signal.signal(sig, signal.default_int_handler)
    try:
        run_and_report(args)
    finally:  # a caller (the tests) keeps its own handlers
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def run_and_report(args: argparse.Namespace) -> None:
    """Start the server, soak it, print the summary and write soak.json and soak.png."""
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = machine_load()
    print(f"load before: {load_before}", flush=True)
    env = {"LAPGUARD_MAX_BODY_BYTES": str(args.max_body_bytes)}
    process, url = start_server(
        args.bundle, flags=["--device", args.device], env=env, in_process=args.small
    )
    try:
        result = run_soak(args, process, url)
    except KeyboardInterrupt:
        raise SystemExit("interrupted: the server is stopped, nothing written") from None
    finally:
        if process.poll() is None:  # Ctrl-C or an error: the server must not outlive us
            stop_server(process)
    result["load"] = {"before": load_before, "after": machine_load()}
    result["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print_summary(result["summary"])
    print(f"load after: {result['load']['after']}")
    (args.out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result["windows"], args.out / "soak.png")
    print(f"wrote {args.out / 'soak.json'} and {args.out / 'soak.png'}")


if __name__ == "__main__":
    main()
