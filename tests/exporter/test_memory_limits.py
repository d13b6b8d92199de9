"""A real exporter fed records at the schema's limits until every limit is hit: its RSS
levels off under the worst-case formula of docs/reliability.md instead of growing with what it
is sent.

About 30 s: small limits (8 ranks, 8 MiB of history) so that each is reached within a
few rounds, then as many rounds again to show nothing grows once they are.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from ampscope.exporter.state.ranks import SAMPLES_PER_WINDOW
from ampscope.reporter.schema import IngestBatch
from bench.limits import exporter, object_sizes, post, record_at_limits, rss_bytes

MiB = 1024 * 1024
RANKS = 8
SERIES_PER_RANK = 16 + 2 + 16 + 16 + 32
"""A rank at the limits: per-rank series (rank states included), aligned scale, 2 x 16
devices, 32 params."""
HISTORY_BYTES = 8 * MiB
LIMITS = {
    "AMPSCOPE_MAX_RUNS": "1",
    "AMPSCOPE_MAX_RANKS": str(RANKS),
    # The last rank's small first record fits, its records at the limits never do.
    "AMPSCOPE_MAX_SERIES": str(RANKS * SERIES_PER_RANK - 8),
    "AMPSCOPE_HISTORY_LENGTH": "64",
    "AMPSCOPE_HISTORY_BYTES": str(HISTORY_BYTES),
}
ROUNDS = 16
RECORDS_PER_BATCH = 8


def _body(run: str, rank: int, first: int, *, small: bool = False) -> bytes:
    now = time.time()
    size = {"devices": 0, "params": 0} if small else {}
    records = [
        record_at_limits(run, rank, step, now, **size)
        for step in range(first, first + RECORDS_PER_BATCH)
    ]
    return (
        IngestBatch(schema_version=1, records=records, dropped_records=0).model_dump_json().encode()
    )


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.load(response)


def _limit(url: str, body: bytes) -> str:
    request = urllib.request.Request(
        f"{url}/api/v1/ingest", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        urllib.request.urlopen(request, timeout=60).close()
    except urllib.error.HTTPError as exc:
        answer = json.loads(exc.read())
        return str(answer.get("limit") if exc.code == 429 else (exc.code, answer))
    return "accepted"


def test_rss_levels_off_under_the_budget_once_every_limit_is_hit() -> None:
    sizes = object_sizes()
    with exporter(LIMITS) as (url, pid):
        idle = rss_bytes(pid)
        last = RANKS - 1
        assert post(url, _body("run0", last, 1, small=True)) == 200
        seen: dict[str, int] = {}
        rss = []
        for round_ in range(ROUNDS):
            first = 2 + round_ * RECORDS_PER_BATCH
            for rank in range(RANKS + 1):  # rank 8 is one rank too many
                outcome = _limit(url, _body("run0", rank, first))
                seen[outcome] = seen.get(outcome, 0) + 1
            seen_run = _limit(url, _body("run1", 0, first))  # one run too many
            seen[seen_run] = seen.get(seen_run, 0) + 1
            rss.append(rss_bytes(pid))
        held = [_get(f"{url}/api/v1/runs/run0/ranks/{r}/history?limit=1000") for r in range(RANKS)]
    assert seen["max_runs"] == ROUNDS
    assert seen["max_ranks"] == ROUNDS
    assert seen["max_series"] == ROUNDS  # the last rank's records at the limits
    assert seen["accepted"] == ROUNDS * (RANKS - 1)
    # History was kept up to the byte budget, oldest first: not vacuously small.
    record_bytes = len(_body("run0", 0, 1)) / RECORDS_PER_BATCH
    held_records = sum(len(h["records"]) for h in held)
    assert HISTORY_BYTES / 2 <= held_records * record_bytes <= HISTORY_BYTES
    assert all(h["newest_held_step"] == 1 + ROUNDS * RECORDS_PER_BATCH for h in held[:-1])
    # The formula of docs/reliability.md at these limits, with the measured object sizes.
    per_rank = sizes["parsed_record_bytes"] + (SAMPLES_PER_WINDOW + 2) * sizes["sample_dicts_bytes"]
    transient = 32 * MiB  # a batch being parsed, a scrape, allocator slack
    bound = idle + RANKS * per_rank + HISTORY_BYTES + transient
    assert max(rss) <= bound, (idle, rss, bound)
    # Level: the second half of the run (every limit long hit) adds next to nothing,
    # though it is sent as much as the first half (~14 MiB of JSON per round).
    half = ROUNDS // 2
    assert max(rss[half:]) - rss[half - 1] <= 4 * MiB, [r // MiB for r in rss]
    print(f"idle {idle / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB, RSS per round (MiB):")
    print([round(r / MiB) for r in rss])
