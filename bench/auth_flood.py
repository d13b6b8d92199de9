"""Basic auth under a flood of wrong passwords: do scrapes and ingest still get answered?

``python -m bench.auth_flood [--attackers 40] [--requests 40]`` starts ``ampscope serve``
with a web config holding one bcrypt user (cost 10, as ``htpasswd -nBC 10`` makes) and a
token, then measures, side by side in one run, the latency of an authorised ``/metrics``
scrape and of a token-authenticated heartbeat: first alone, then while ``--attackers``
threads post wrong passwords as fast as they are answered, each on a new connection. Prints
medians, 95th percentiles and the ratio flood/quiet, and how many wrong passwords the
exporter answered meanwhile.

``flood`` is shared with ``tests/exporter/security/test_auth_flood.py``, which asserts only that
every authorised request is answered.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import bcrypt

from bench.servers import ServerProcess

USER, PASSWORD, TOKEN = "prometheus", "right-password", "rank-token"
HEARTBEAT = json.dumps(
    {"schema_version": 1, "identity": {"run": "flood", "node": "n", "rank": 0, "local_rank": 0,
     "world_size": 1}, "time": 1.0, "step": 0, "final": False, "dropped_records": 0}
).encode()  # fmt: skip


@dataclass
class FloodResult:
    scrape_s: list[float] = field(default_factory=list)
    """Latency of each authorised /metrics scrape."""
    ingest_s: list[float] = field(default_factory=list)
    """Latency of each token-authenticated heartbeat."""
    statuses: list[int] = field(default_factory=list)
    """Statuses of the authorised requests, in order."""
    wrong_answered: int = 0
    """Wrong-password requests the exporter answered (401) while the flood ran."""
    attackers_refused: int = 0
    """Attackers answered 401 before the authorised requests started (all of them, unless
    the exporter stopped answering)."""


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _request(
    port: int, method: str, path: str, headers: dict[str, str], body: bytes | None = None
) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def flood(port: int, *, attackers: int, requests: int) -> FloodResult:
    """Authorised scrapes and heartbeats, ``requests`` of each, while ``attackers`` threads
    send wrong passwords (``attackers=0``: no flood). The authorised requests start once
    every attacker has been answered at least once, so they really run under the flood."""
    result = FloodResult()
    stop = threading.Event()
    answered = threading.Semaphore(0)
    lock = threading.Lock()

    def attack(index: int) -> None:
        first = True
        n = 0
        while not stop.is_set():
            n += 1
            try:
                status = _request(
                    port, "GET", "/metrics", {"Authorization": _basic(USER, f"x{index}-{n}")}
                )
            except OSError:
                continue
            if status != 401:
                continue
            with lock:
                result.wrong_answered += 1
            if first:
                first = False
                answered.release()

    threads = [threading.Thread(target=attack, args=(i,), daemon=True) for i in range(attackers)]
    for thread in threads:
        thread.start()
    result.attackers_refused = sum(answered.acquire(timeout=120) for _ in range(attackers))
    with lock:
        result.wrong_answered = 0
    scrape = {"Authorization": _basic(USER, PASSWORD)}
    ingest = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    for _ in range(requests):
        started = time.perf_counter()
        result.statuses.append(_request(port, "GET", "/metrics", scrape))
        result.scrape_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        result.statuses.append(_request(port, "POST", "/api/v1/heartbeat", ingest, HEARTBEAT))
        result.ingest_s.append(time.perf_counter() - started)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    return result


def web_config(directory: Path, cost: int = 10) -> Path:
    """A web config with one bcrypt user, and the token file, in ``directory``."""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(cost)).decode()
    path = directory / "web-config.yml"
    path.write_text(f"basic_auth_users:\n  {USER}: '{hashed}'\n")
    (directory / "token").write_text(TOKEN)
    return path


def exporter(directory: Path) -> ServerProcess:
    """``ampscope serve`` with the web config and token of ``web_config(directory)``."""
    return ServerProcess(
        name="ampscope",
        argv=[sys.executable, "-m", "ampscope.cli", "serve", "--port", "{port}",
              "--web-config-file", str(directory / "web-config.yml"),
              "--token-file", str(directory / "token"), "--log-level", "warning"],
        ready_path="/healthz",
    )  # fmt: skip


def _summary(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[int(0.95 * (len(ordered) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.auth_flood", description=__doc__)
    parser.add_argument("--attackers", type=int, default=40)
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        web_config(Path(tmp))
        with exporter(Path(tmp)) as server:
            port = server.port
            # Warm: the right password verified once, then served from the cache.
            _request(port, "GET", "/metrics", {"Authorization": _basic(USER, PASSWORD)})
            quiet = flood(port, attackers=0, requests=args.requests)
            loud = flood(port, attackers=args.attackers, requests=args.requests)
    print(f"{args.attackers} attackers, {args.requests} authorised scrapes and heartbeats each")
    print(f"wrong passwords answered during the flood: {loud.wrong_answered}")
    print(f"statuses under flood: {sorted(set(loud.statuses))}")
    for name, a, b in (("scrape", quiet.scrape_s, loud.scrape_s),
                       ("heartbeat", quiet.ingest_s, loud.ingest_s)):  # fmt: skip
        (qm, q95), (lm, l95) = _summary(a), _summary(b)
        print(
            f"{name:9s} quiet median {qm * 1e3:6.1f} ms p95 {q95 * 1e3:6.1f} ms | flood median "
            f"{lm * 1e3:6.1f} ms p95 {l95 * 1e3:6.1f} ms | ratio {lm / qm:4.1f}x"
        )


if __name__ == "__main__":
    main()
