"""Replicas of `lapguard serve` behind one nginx on loopback: started together, stopped together
(tests/test_cluster.py and :mod:`benchmarks.cluster_throughput`).

nginx (Debian's, ``make system-tools``) runs from a configuration written to a temporary folder,
as this user, one ``listen`` on a free loopback port per upstream group. A request that meets a
connection error, a reset, a 502 or a 503 goes to the next replica, POST included
(``non_idempotent``: scoring an image twice changes nothing but the query memory, which a replica
that failed mid-request may not have written anyway).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.local_server import Server, start_server, stop_server
from benchmarks.peer_servers import free_port

NGINX_CONFIG = """\
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    client_max_body_size 64m;
{servers}
}}
"""
GROUP = """\
    upstream group{index} {{
{upstreams}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://group{index};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Forwarded-For $remote_addr;
            proxy_next_upstream error timeout http_502 http_503 non_idempotent;
            proxy_next_upstream_tries {tries};
            proxy_read_timeout 60s;
        }}
    }}"""


def nginx_config(directory: Path, groups: Sequence[Sequence[str]], ports: Sequence[int]) -> str:
    """nginx's configuration: group ``i`` (``host:port`` upstreams) served on ``ports[i]``, every
    file it writes under ``directory``."""
    servers = []
    for index, (group, port) in enumerate(zip(groups, ports, strict=True)):
        upstreams = "\n".join(
            f"        server {address} max_fails=1 fail_timeout=5s;" for address in group
        )
        tries = len(group) + 1
        servers.append(GROUP.format(index=index, upstreams=upstreams, port=port, tries=tries))
    return NGINX_CONFIG.format(dir=directory, servers="\n".join(servers))


class Balancer:
    """nginx on free loopback ports, one per upstream group, until :meth:`stop`; ``urls[i]``
    balances group ``i``."""

    def __init__(self, groups: Sequence[Sequence[str]], timeout: float = 30) -> None:
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(binary).is_file():
            raise SystemExit("nginx is not installed: run `make system-tools` (Debian nginx)")
        self.directory = Path(tempfile.mkdtemp(prefix="lapguard-nginx-"))
        ports = [free_port() for _ in groups]
        config = self.directory / "nginx.conf"
        config.write_text(nginx_config(self.directory, groups, ports))
        command = [binary, "-p", str(self.directory), "-e", str(self.directory / "error.log"),
                   "-c", str(config)]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.urls = [f"http://127.0.0.1:{port}" for port in ports]
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for url in self.urls:
            while not _answers(url):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"nginx did not start: {self.log()[-2000:]}")
                time.sleep(0.05)

    def log(self) -> str:
        """nginx's error log so far."""
        path = self.directory / "error.log"
        return path.read_text() if path.is_file() else ""

    def stop(self) -> None:
        """A fast stop (SIGTERM), then its folder removed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)


def _answers(url: str) -> bool:
    """True once something answers HTTP at ``url`` (any status)."""
    try:
        httpx.get(url + "/healthz", timeout=1)
        return True
    except httpx.HTTPError:
        return False


class Cluster:
    """``replicas`` × `lapguard serve` on ``bundle`` (``flags`` and LAPGUARD_* ``env`` each;
    started at once, each in a subprocess, or in threads of this process with ``in_process``)
    behind one :class:`Balancer`, whose ``groups`` (lists of replica indices, default all of
    them) are served at ``urls``; ``url`` is the first. A context manager: stops everything."""

    def __init__(
        self,
        bundle: Path,
        *,
        replicas: int = 2,
        flags: Sequence[str] = (),
        env: dict[str, str] | None = None,
        groups: Sequence[Sequence[int]] | None = None,
        in_process: bool = False,
    ) -> None:
        def start(_: int) -> tuple[Server, str]:
            return start_server(bundle, flags=list(flags), env=env, in_process=in_process)

        with ThreadPoolExecutor(replicas) as pool:
            started = list(pool.map(start, range(replicas)))
        self.servers = [server for server, _ in started]
        self.replica_urls = [url for _, url in started]
        addresses = [url.removeprefix("http://") for url in self.replica_urls]
        groups = groups if groups is not None else [range(replicas)]
        try:
            self.balancer = Balancer([[addresses[i] for i in group] for group in groups])
        except BaseException:
            self.stop_replicas()
            raise
        self.urls = self.balancer.urls
        self.url = self.urls[0]

    def kill(self, index: int) -> None:
        """SIGKILL replica ``index`` (no drain: its open connections are reset)."""
        server = self.servers[index]
        if isinstance(server, subprocess.Popen):
            server.kill()
            server.wait(timeout=10)
        else:
            server.kill()

    def stop_replicas(self) -> None:
        for server in self.servers:
            if server.poll() is None:
                stop_server(server)

    def stop(self) -> None:
        """The balancer, then every replica still running (graceful)."""
        self.balancer.stop()
        self.stop_replicas()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
