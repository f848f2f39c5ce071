"""``wrk`` (C, one thread) as the benchmarks' HTTP load generator: it takes little of the cores the
server under test needs, unlike a Python generator. :func:`ensure_wrk` installs Debian's package
when ``wrk`` is not on PATH (a fresh machine), so a benchmark never silently falls back."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "{content_type}"
local f = assert(io.open("{body}", "rb"))
wrk.body = f:read("*a")
f:close()
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def ensure_wrk() -> str:
    """The path of ``wrk``, installed with apt-get (as root) when missing."""
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() != 0:
        raise SystemExit("wrk is not installed and this is not root: run `apt-get install wrk`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print("installing wrk (apt-get install wrk) ...", flush=True)
    install = ["apt-get", "install", "-y", "-qq", "wrk"]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True, capture_output=True)
        subprocess.run(install, env=env, check=True, capture_output=True)
    found = shutil.which("wrk")
    if not found:
        raise SystemExit("apt-get installed wrk but it is not on PATH")
    return found


def run_wrk(
    url: str, body: bytes, content_type: str, *, clients: int, seconds: float
) -> dict[str, float]:
    """``wrk`` POSTing ``body`` to ``url`` from ``clients`` keep-alive connections for ``seconds``:
    requests/s, requests, p50/p99 latency (ms) and the count of non-2xx answers and socket errors."""
    with tempfile.TemporaryDirectory(prefix="wrk-") as tmp:
        path = Path(tmp, "body.bin")
        path.write_bytes(body)
        script = Path(tmp, "post.lua")
        script.write_text(_SCRIPT.format(content_type=content_type, body=path))
        command = [ensure_wrk(), "-t1", f"-c{clients}", f"-d{max(1, round(seconds))}s"]
        command += ["--latency", "--timeout", "30s", "-s", str(script), url]
        output = subprocess.run(
            command, capture_output=True, text=True, timeout=seconds + 60, check=True
        ).stdout
    return parse_wrk(output)


def parse_wrk(output: str) -> dict[str, float]:
    """The figures of ``wrk --latency``'s report."""

    def latency(percent: str) -> float:
        found = re.search(rf"^\s*{percent}%\s+([\d.]+)(us|ms|s)\s*$", output, re.MULTILINE)
        if found is None:
            raise SystemExit(f"no {percent}% latency in wrk's output:\n{output}")
        return float(found.group(1)) * _UNITS[found.group(2)]

    rate = re.search(r"Requests/sec:\s+([\d.]+)", output)
    requests = re.search(r"(\d+) requests in", output)
    if rate is None or requests is None:
        raise SystemExit(f"cannot read wrk's output:\n{output}")
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    sockets = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    return {
        "rate": float(rate.group(1)),
        "requests": float(requests.group(1)),
        "p50": latency("50"),
        "p99": latency("99"),
        "errors": float(bad.group(1)) if bad else 0.0,
        "socket_errors": float(sum(int(g) for g in sockets.groups())) if sockets else 0.0,
    }
