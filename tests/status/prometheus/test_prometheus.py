"""``ampscope status --prometheus`` against a real Prometheus scraping three real exporters
that stand in for three nodes, with ranks reporting through the real reporter; it must
give the same answer for the run as the multi-``--url`` fan-out over those exporters."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from status_cli import run_status
from support import DEADLOCK_GUARD_S, free_port, need_tool, start_prometheus, stop_process

from ampscope.demo.exporter import ExporterProcess
from ampscope.status.prometheus.health import SKIP_DETAIL

RUN = "job-9"
LAYOUT = {"n0": (0, 1), "n1": (2, 3), "n2": (4,)}
"""Node -> ranks that report; world size 6, so rank 5 never reports."""
HOT_RANK = 2
"""Its gradients hold inf at every step of the second phase: an inf hotspot on node n1 and
a skip storm (policy skip), while every other rank stays clean."""
PHASES = ((1, 4), (5, 20))


def _query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        return json.load(response)["data"]["result"]


def _until(prometheus: str, promql: str, expected: set[tuple[str, float]]) -> None:
    """Wait until ``promql`` gives (rank, value) ``expected``: Prometheus scraped them."""
    deadline = time.monotonic() + DEADLOCK_GUARD_S * 2
    while True:
        got = {(s["metric"]["rank"], float(s["value"][1])) for s in _query(prometheus, promql)}
        if got == expected:
            return
        assert time.monotonic() < deadline, (promql, got)
        time.sleep(0.2)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """(Prometheus URL, node -> exporter URL) once every rank finished and was scraped."""
    need_tool("prometheus")
    import torch

    import ampscope
    from ampscope.reporter.http import HttpReporter

    workdir = tmp_path_factory.mktemp("prometheus")
    exporters = {node: ExporterProcess(free_port()) for node in LAYOUT}
    prometheus = None
    try:
        for process in exporters.values():
            process.start()
        targets = [process.url.removeprefix("http://") for process in exporters.values()]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "ampscope", "static_configs": [{"targets": targets}]}],
        }
        prometheus, prometheus_url = start_prometheus(config, workdir)
        ranks = [(node, rank) for node, members in LAYOUT.items() for rank in members]
        models = {rank: torch.nn.Linear(4, 1) for _, rank in ranks}
        optimizers = {r: torch.optim.SGD(m.parameters(), lr=1e-3) for r, m in models.items()}
        watches = {
            rank: ampscope.GradWatch(
                "skip",
                reporter=HttpReporter(exporters[node].url, flush_interval=0.05),
                run_id=RUN,
            )
            for node, rank in ranks
        }

        def train(node: str, rank: int, first: int, last: int) -> None:
            env = {"AMPSCOPE_NODE": node, "RANK": str(rank), "LOCAL_RANK": str(rank % 2),
                   "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"}  # fmt: skip
            with pytest.MonkeyPatch.context() as patch:
                for name, value in env.items():
                    patch.setenv(name, value)
                for _ in range(first, last + 1):
                    batch = torch.ones(2, 4)
                    if rank == HOT_RANK and first > 1:
                        batch[0, 0] = float("inf")
                    watches[rank].scale(models[rank](batch).pow(2).mean()).backward()
                    watches[rank].step(optimizers[rank])
                    watches[rank].update()
                    optimizers[rank].zero_grad()

        # Phase one, then wait until Prometheus holds it: its counters' increase over the
        # windows then spans phase two, as it would over a long run.
        for first, last in PHASES:
            for node, rank in ranks:
                train(node, rank, first, last)
            _until(prometheus_url, "ampscope_last_step", {(str(r), float(last)) for _, r in ranks})
        for watch in watches.values():
            watch.close()
        _until(
            prometheus_url,
            'ampscope_rank_state{state="finished"}',
            {(str(r), 1.0) for _, r in ranks},
        )
        yield prometheus_url, {node: process.url for node, process in exporters.items()}
    finally:
        if prometheus is not None:
            stop_process(prometheus)
        for process in exporters.values():
            process.stop()


def _by_rule(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["rule"]: v for v in answer["health"]["verdicts"]}


def test_prometheus_and_the_fan_out_give_the_same_answer(
    job: tuple[str, dict[str, str]],
) -> None:
    prometheus_url, nodes = job
    urls = [arg for url in nodes.values() for arg in ("--url", url)]
    via_prometheus = run_status(RUN, "--json", "--prometheus", prometheus_url)
    via_exporters = run_status(RUN, "--json", *urls)
    assert via_prometheus.returncode == via_exporters.returncode == 1, via_prometheus.stderr
    answers = [json.loads(via_prometheus.stdout), json.loads(via_exporters.stdout)]
    for answer in answers:
        assert answer["missing_ranks"] == [5]
        assert [(r["rank"], r["node"]) for r in answer["ranks"]] == [
            (0, "n0"), (1, "n0"), (2, "n1"), (3, "n1"), (4, "n2"),
        ]  # fmt: skip
        verdicts = _by_rule(answer)
        assert verdicts["missing_rank"]["status"] == "warning"
        hotspot = verdicts["inf_hotspot"]
        assert hotspot["status"] == "warning"
        assert (hotspot["evidence"]["top"][0]["rank"], hotspot["evidence"]["top"][0]["node"]) == (
            HOT_RANK,
            "n1",
        )
        assert verdicts["skip_storm"]["status"] == "warning"
        assert verdicts["scale_collapse"]["status"] == "ok"
        assert verdicts["lost_rank"]["status"] == "ok"
        assert answer["health"]["states"]["finished"] == 5
    # The same counts where Prometheus saw them all: increase() extrapolates, capped at the
    # counter. Its steps start at its first scrape (step 4 or later), the exporters' at 1.
    from_prometheus, from_exporters = answers
    storm = [_by_rule(answer)["skip_storm"]["evidence"]["ranks"][0] for answer in answers]
    assert [(e["rank"], e["skipped"]) for e in storm] == [(HOT_RANK, 16)] * 2
    assert storm[1]["steps"] == 20
    assert 16 <= storm[0]["steps"] <= 20
    hot = [_by_rule(answer)["inf_hotspot"]["evidence"] for answer in answers]
    assert [(e["detections"], e["top"][0]["detections"]) for e in hot] == [(16, 16)] * 2
    # The hot rank's watch skipped those 16 steps (policy skip): named by both, the exporter
    # with its last step (origin not tracked here), Prometheus with the count alone.
    skipped = [_by_rule(answer)["nonfinite_skipped"] for answer in answers]
    for verdict in skipped:
        assert verdict["status"] == "warning"
        assert verdict["evidence"]["skipped"] == 16
        assert [(r["rank"], r["node"]) for r in verdict["evidence"]["ranks"]] == [(HOT_RANK, "n1")]
    assert skipped[1]["evidence"]["last_step"] == 20
    assert skipped[1]["evidence"]["origin_tracked"] is False
    assert "last_step" not in skipped[0]["evidence"]
    assert skipped[0]["summary"].endswith(f"({SKIP_DETAIL.format(run=RUN)})")
    # The single exporter's keys, every one; null where Prometheus lacks a value.
    assert set(from_prometheus) >= {"url", "run", "ranks", "health", "missing_ranks"}
    assert set(from_prometheus["ranks"][0]) == set(from_exporters["ranks"][0])
    assert set(from_prometheus["health"]) == set(from_exporters["health"])
    assert from_prometheus["ranks"][0]["step_time"] is None
    assert from_prometheus["ranks"][0]["step"] == 20
    stalled = _by_rule(from_prometheus)["stalled_rank"]
    assert stalled["evidence"] == {"evaluated": False}
    assert stalled["summary"].startswith("not evaluated from Prometheus: it needs")
    desync = _by_rule(from_prometheus)["scale_desync"]
    assert (desync["status"], desync["evidence"]["source"]) == ("ok", "aligned")


def test_the_prometheus_table_and_its_failures(job: tuple[str, dict[str, str]]) -> None:
    prometheus_url, _ = job
    result = run_status(RUN, "--prometheus", prometheus_url)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert f"from Prometheus at {prometheus_url}" in lines[0]
    assert lines[1] == "missing ranks (1): 5"
    rows = {line.split()[0]: line.split()[-1] for line in lines[4:7]}
    assert rows == {"n0": "OK", "n1": "WARNING", "n2": "OK"}
    listing = run_status("--prometheus", prometheus_url)
    assert listing.returncode == 1
    assert listing.stdout.splitlines()[1].split()[:3] == [RUN, "WARNING", "5/5"]
    assert run_status("no-such-run", "--prometheus", prometheus_url).returncode == 4
    dead = run_status(RUN, "--prometheus", f"http://127.0.0.1:{free_port()}")
    assert dead.returncode == 3
    assert "no Prometheus answers at" in dead.stderr


def test_credentials_come_from_a_file_or_the_environment(
    job: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    prometheus_url, _ = job
    missing = run_status(RUN, "--prometheus", prometheus_url, "--bearer-token-file", "/nonexistent")
    assert missing.returncode == 5
    assert "cannot read --bearer-token-file" in missing.stderr
    # Prometheus itself ignores an Authorization header it does not require.
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    result = run_status(RUN, "--prometheus", prometheus_url, "--bearer-token-file", str(token))
    assert result.returncode == 1


def _sample(name: str, rank: int, value: float, **labels: str) -> dict[str, Any]:
    metric = {"__name__": name, "run": RUN, "node": f"n{rank // 2}", "rank": str(rank),
              "local_rank": str(rank % 2), **labels}  # fmt: skip
    return {"metric": metric, "value": [0.0, str(value)]}


def test_spike_verdicts_count_what_prometheus_holds() -> None:
    from ampscope.status import prometheus
    from ampscope.status.prometheus import health
    from ampscope.status.prometheus.ranks import build_views, grown_within, per_rank
    from ampscope.verdicts.thresholds import Thresholds

    t = Thresholds()
    # Counted as the spike alerts count (a gap in the scrapes counts no old spike: the
    # VictoriaMetrics gaps test).
    assert prometheus.queries(RUN, t)["spikes"] == (
        grown_within(f'ampscope_spikes_total{{run="{RUN}"}}', 600) + " > 0"
    )
    now = 1_700_000_000.0
    samples = []
    for rank in range(4):
        samples += [
            _sample("ampscope_rank_info", rank, 1.0, mode="scaler", world_size="4"),
            _sample("ampscope_last_report_timestamp_seconds", rank, now - 1),
            _sample("ampscope_rank_up", rank, 1.0),
            _sample("ampscope_rank_state", rank, 1.0, state="running"),
        ]
    views = build_views(samples, now)
    # increase() extrapolates: one spike reads a little more than 1. The grad norm is the
    # same on every rank, so every rank counted it; rank 3's own gradients stood out twice.
    spikes = [
        *(_sample("", r, 1.07, kind="grad_norm") for r in range(4)),
        _sample("", 1, 1.07, kind="loss"),
        _sample("", 3, 2.1, kind="origin_outlier"),
        _sample("", 0, 0.0, kind="loss"),
    ]
    windows = {name: {} for name in prometheus.queries(RUN, t) if name != "now"}
    windows["spikes"] = per_rank(spikes, views)
    ranks = sorted(views.values(), key=lambda v: v["rank"])
    report = prometheus.health_of(RUN, ranks, windows, t, now)
    verdicts = {v["rule"]: v for v in report["verdicts"]}
    loss = verdicts["loss_spike"]
    assert loss["status"] == "warning"
    assert [(r["rank"], r["node"], r["spikes"]) for r in loss["evidence"]["ranks"]] == [
        (1, "n0", 1)
    ]
    assert loss["summary"].startswith("rank 1 (node n0) had a loss spike; 1 spike iteration(s)")
    assert health.SPIKE_DETAIL.format(run=RUN) in loss["summary"]
    norm = verdicts["grad_norm_spike"]
    assert (norm["status"], norm["evidence"]["spikes"], norm["evidence"]["ranks_seen"]) == (
        "warning",
        1,
        4,
    )
    outlier = verdicts["origin_outlier"]
    assert outlier["summary"].startswith("rank 3's own gradients stood out (node n1)")
    assert "it stood out at 2 steps" in outlier["summary"]
    assert outlier["evidence"]["source"] == "prometheus"
    assert report["status"] == "warning"


def test_replica_divergence_counts_the_ranks_whose_group_diverged() -> None:
    from ampscope.status import prometheus
    from ampscope.status.prometheus import health
    from ampscope.status.prometheus.ranks import build_views, per_rank
    from ampscope.verdicts.thresholds import Thresholds

    t = Thresholds()
    assert prometheus.queries(RUN, t)["replica_checks"] == (
        f'ampscope_replica_checks_total{{result="diverged",run="{RUN}"}} > 0'
    )
    now = 1_700_000_000.0
    samples = []
    for rank in range(4):
        samples += [
            _sample("ampscope_rank_info", rank, 1.0, mode="watch", world_size="4"),
            _sample("ampscope_last_report_timestamp_seconds", rank, now - 1),
            _sample("ampscope_rank_up", rank, 1.0),
            _sample("ampscope_rank_state", rank, 1.0, state="running"),
        ]
    views = build_views(samples, now)
    ranks = sorted(views.values(), key=lambda v: v["rank"])
    windows = {name: {} for name in prometheus.queries(RUN, t) if name != "now"}
    # HSDP 2 x 2: the group of ranks 1 and 3 diverged twice; every rank's checks agreed before.
    checks = [_sample("", r, 5.0, result="agree") for r in range(4)]
    checks += [_sample("", r, 2.0, result="diverged") for r in (1, 3)]
    windows["replica_checks"] = per_rank(checks, views)
    verdict = {v["rule"]: v for v in prometheus.health_of(RUN, ranks, windows, t, now)["verdicts"]}[
        "replica_divergence"
    ]
    assert verdict["status"] == "critical"
    assert [r["rank"] for r in verdict["evidence"]["ranks"]] == [1, 3]
    assert verdict["evidence"]["checks_diverged"] == 4
    assert verdict["evidence"]["source"] == "prometheus"
    assert health.REPLICA_DETAIL.format(run=RUN) in verdict["summary"]
    windows["replica_checks"] = per_rank(checks[:4], views)  # agreeing only: silent
    calm = {v["rule"]: v for v in prometheus.health_of(RUN, ranks, windows, t, now)["verdicts"]}
    assert calm["replica_divergence"]["status"] == "ok"


def test_a_stopped_rank_reads_its_stop_and_world_from_the_series_there() -> None:
    """``stopped_rank`` from Prometheus: the stop is ``ampscope_last_report_timestamp_seconds``,
    the world ``ampscope_rank_info``'s ``world_size``; a rank whose series are gone (its
    exporter dropped it ``--finished-retention`` after its goodbye) counts no more, as
    ``AmpscopeRankStopped`` cannot see it."""
    from ampscope.status import prometheus
    from ampscope.status.prometheus.ranks import build_views
    from ampscope.verdicts.thresholds import Thresholds

    t, now = Thresholds(), 1_700_000_000.0
    # Ranks 0 and 1 run; rank 2 was evicted 400 s ago; rank 3 too, its series gone since;
    # rank 4 of an older, larger world (an elastic shrink from 5 to 4) stays stopped.
    given = {0: ("running", now - 1, "4"), 1: ("stalled", now - 1, "4"),
             2: ("stopped", now - 400, "4"), 3: ("stopped", now - 400, "4"),
             4: ("stopped", now - 400, "5")}  # fmt: skip
    samples = []
    for rank, (state, heard, world) in given.items():
        samples += [
            _sample("ampscope_rank_info", rank, 1.0, mode="scaler", world_size=world),
            _sample("ampscope_last_report_timestamp_seconds", rank, heard),
            _sample("ampscope_rank_state", rank, 1.0, state=state),
        ]
    views = build_views(samples, now)
    ranks = sorted(views.values(), key=lambda v: v["rank"])
    windows = {name: {} for name in prometheus.queries(RUN, t) if name != "now"}

    def stopped(gone: set[int]) -> dict[str, Any]:
        report = prometheus.health_of(RUN, ranks, windows, t, now, gone=gone)
        return {v["rule"]: v for v in report["verdicts"]}["stopped_rank"]

    verdict = stopped({3})
    assert verdict["status"] == "warning"
    assert [(r["rank"], r["seconds_since_stop"]) for r in verdict["evidence"]["ranks"]] == [
        (2, 400.0)
    ]
    assert stopped(set())["status"] == "critical"  # ranks 2 and 3: half the world of 4
