"""A :class:`~bench.simulated_job.SimulatedJob` written into a Prometheus TSDB, so the
benchmarks that read it from VictoriaMetrics (``bench.victoria``) can read the same job from
Prometheus too.

Prometheus has no import endpoint for timestamped samples; ``promtool tsdb
create-blocks-from openmetrics`` (its documented backfill) writes them as blocks into a data
directory a Prometheus then serves. Each scrape's samples get the ``job`` and ``instance``
labels the scrape would have added (as ``load_job`` adds them on import), and their
millisecond timestamps become OpenMetrics' seconds. Backfilled samples carry no staleness
markers, as VictoriaMetrics' imported ones carry none: both stores see a series for the 5-minute
lookback after its last sample.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.simulated_job import SimulatedJob
from bench.victoria import EXPORTER_PORT, SCRAPE_JOB

BLOCKS = "tsdb"
"""The folder of the data directory that holds the blocks (the ``--storage.tsdb.path``)."""

NEWEST = "newest-scrape"
"""The file of the data directory that holds the newest scrape's Unix time."""


def openmetrics_lines(body: bytes, labels: bytes) -> Iterator[bytes]:
    """OpenMetrics sample lines of one scrape's timestamped exposition (``body``, as
    ``SimulatedJob.scrapes`` yields it), ``labels`` (``job="…",instance="…"``) added to each;
    every family left untyped (``promtool`` reads the samples, not the types)."""
    for line in body.split(b"\n"):
        if not line:
            continue
        head, value, stamp = line.rsplit(b" ", 2)
        if head.endswith(b"}"):
            name, rest = head.split(b"{", 1)
            head = name + b"{" + labels + b"," + rest
        else:
            head += b"{" + labels + b"}"
        yield b"%s %s %.3f\n" % (head, value, int(stamp) / 1000)


def backfill(job: SimulatedJob, data_dir: Path, promtool: str) -> dict[str, Any]:
    """Write every scrape of ``job`` (newest timed now) as blocks under ``data_dir`` /
    ``BLOCKS``, and the newest scrape's time in ``data_dir`` / ``NEWEST``. Costs a temporary
    OpenMetrics file of about 160 bytes a sample (1.4 GB at 1,024 nodes x 8 ranks) under
    ``data_dir``; rendering the scrapes takes most of the time, ``promtool`` under half.

    Returns:
        samples, seconds and the newest scrape's time.
    """
    started = time.perf_counter()
    samples = 0
    newest = 0.0
    (data_dir / BLOCKS).mkdir(parents=True)
    with tempfile.NamedTemporaryFile(suffix=".om", dir=data_dir) as text:
        for index, now, body in job.scrapes():
            node = job.node_name(index)
            labels = b'job="%s",instance="%s:%d"' % (
                SCRAPE_JOB.encode(),
                node.encode(),
                EXPORTER_PORT,
            )
            for line in openmetrics_lines(body, labels):
                text.write(line)
                samples += 1
            newest = now
        text.write(b"# EOF\n")
        text.flush()
        subprocess.run(
            [promtool, "tsdb", "create-blocks-from", "openmetrics", text.name, BLOCKS],
            cwd=data_dir,
            check=True,
            capture_output=True,
        )
    (data_dir / NEWEST).write_text(f"{newest!r}\n")
    return {"samples": samples, "seconds": time.perf_counter() - started, "newest_scrape": newest}


def newest_scrape(data_dir: Path) -> float:
    """The newest scrape's Unix time that ``backfill`` wrote under ``data_dir``."""
    return float((data_dir / NEWEST).read_text())
