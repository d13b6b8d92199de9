"""Concurrent pushers and scrapers against a loopback HTTP server.

Each simulated rank gets its own thread and keep-alive connection, as real ranks each
hold their own. All threads start together on a barrier; request bodies are built before
the clock starts when ``prebuild`` is set, so the measurement is the server's cost plus
one Python HTTP client per rank, the same client for both servers.
"""

from __future__ import annotations

import gzip as gzip_module
import http.client
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ampscope.reporter.schema import INGEST_PATH
from bench.payloads import SimulatedRank

Request = tuple[str, str, bytes, str]
"""(method, path, body, content type)."""
RequestFactory = Callable[[SimulatedRank], Request]


def ampscope_ingest(records_per_batch: int) -> RequestFactory:
    """POST the rank's next ``records_per_batch`` records as one ``IngestBatch``."""

    def make(rank: SimulatedRank) -> Request:
        body = rank.ingest_batch(records_per_batch)
        return ("POST", INGEST_PATH, body, "application/json")

    return make


def pushgateway_put(records_per_batch: int) -> RequestFactory:
    """PUT the rank's state after ``records_per_batch`` more steps to its Pushgateway group.

    A Pushgateway keeps only the newest value of each series, so one push stands for the
    batch of steps an ampscope reporter would have sent in one request.
    """

    def make(rank: SimulatedRank) -> Request:
        rank.step += records_per_batch - 1
        rank.ingest_batch(1)  # advance the counters exactly as the ampscope side does
        return ("PUT", rank.push_path(), rank.exposition(), "text/plain; version=0.0.4")

    return make


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """What one concurrent push phase measured."""

    requests: int
    seconds: float
    """Wall time from the start barrier until the last pusher finished."""
    latencies: list[float]
    """Per-request seconds, request sent to response read."""
    errors: list[str]
    """One line per non-2xx response or connection error (empty on a clean run)."""
    body_bytes: int
    """Request bodies sent, in total."""

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


def push_concurrently(
    *,
    host: str,
    port: int,
    ranks: Sequence[SimulatedRank],
    requests_per_rank: int,
    make_request: RequestFactory,
    prebuild: bool = True,
    timeout: float = 60.0,
) -> LoadResult:
    """Every rank pushes ``requests_per_rank`` requests at once, each on its own thread.

    Args:
        host: Server address (loopback).
        port: Server port.
        ranks: One simulated rank per pusher thread.
        requests_per_rank: Requests each pusher sends, back to back.
        make_request: Builds a rank's next request (and advances its state).
        prebuild: Build all bodies before the clock starts (memory: every body at once).
        timeout: Socket timeout of each request, in seconds.

    Raises:
        Whatever ``make_request`` raised while the bodies were prebuilt: the start barrier is
        broken for every pusher, so none waits for the one that failed.
    """
    barrier = threading.Barrier(len(ranks) + 1)
    latencies: list[list[float]] = [[] for _ in ranks]
    sent = [0 for _ in ranks]
    errors: list[str] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def pusher(index: int) -> None:
        rank = ranks[index]
        try:
            bodies = [make_request(rank) for _ in range(requests_per_rank)] if prebuild else []
        except BaseException as exc:
            with lock:
                failures.append(exc)
            barrier.abort()  # the others, and the clock, would wait for this one forever
            return
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        mine = latencies[index]
        try:
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                return  # another pusher failed to build its bodies
            for i in range(requests_per_rank):
                method, path, body, ctype = bodies[i] if prebuild else make_request(rank)
                start = time.perf_counter()
                try:
                    conn.request(method, path, body, {"Content-Type": ctype})
                    response = conn.getresponse()
                    detail = response.read()
                except OSError as exc:
                    with lock:
                        errors.append(f"rank {rank.rank}: {exc!r}")
                    conn.close()
                    conn = http.client.HTTPConnection(host, port, timeout=timeout)
                    continue
                mine.append(time.perf_counter() - start)
                sent[index] += len(body)
                if not 200 <= response.status < 300:
                    with lock:
                        errors.append(f"rank {rank.rank}: HTTP {response.status} {detail[:200]!r}")
        finally:
            conn.close()

    threads = [threading.Thread(target=pusher, args=(i,), daemon=True) for i in range(len(ranks))]
    for thread in threads:
        thread.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        for thread in threads:
            thread.join()
        raise failures[0] from None
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    flat = [x for per_rank in latencies for x in per_rank]
    return LoadResult(
        requests=len(flat), seconds=seconds, latencies=flat, errors=errors, body_bytes=sum(sent)
    )


@dataclass(frozen=True, kw_only=True)
class ScrapeResult:
    latencies: list[float]
    """Seconds per GET /metrics, sequential, body fully read."""
    size_bytes: int
    """Body size of the last scrape."""
    samples: int
    """Sample lines in the last scrape (lines not starting with '#')."""


def scrape(
    *, host: str, port: int, times: int, path: str = "/metrics", gzip: bool = False
) -> ScrapeResult:
    """GET ``path`` ``times`` times in a row, as a Prometheus server would, and time each.

    ``gzip=True`` sends ``Accept-Encoding: gzip`` as Prometheus does; the size is then the
    compressed size, and samples are counted in the decompressed body.
    """
    headers = {"Accept-Encoding": "gzip" if gzip else "identity"}
    conn = http.client.HTTPConnection(host, port, timeout=60)
    latencies: list[float] = []
    body = b""
    try:
        for _ in range(times):
            start = time.perf_counter()
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            body = response.read()
            latencies.append(time.perf_counter() - start)
            if response.status != 200:
                raise RuntimeError(f"GET {path} answered {response.status}")
            encoding = response.getheader("Content-Encoding")
            if encoding != ("gzip" if gzip else None):
                raise RuntimeError(f"GET {path} answered Content-Encoding {encoding!r}")
    finally:
        conn.close()
    text = gzip_module.decompress(body) if gzip else body
    samples = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    return ScrapeResult(latencies=latencies, size_bytes=len(body), samples=samples)
