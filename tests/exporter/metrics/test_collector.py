"""/metrics: every catalogue family, values equal to the posted records, promtool-clean."""

from __future__ import annotations

from dataclasses import fields

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from support import need_tool, promtool_check_metrics

from ampscope.exporter.metrics.catalogue import (
    CATALOGUE,
    OFFENCE_KINDS,
    RANK_LABELS,
    SCALER_ONLY,
)
from ampscope.reporter.schema import ReplicaCheckResult, Rerun, RerunPass, WeatherTotals
from ampscope.verdicts.aligned import unpack
from ampscope.verdicts.thresholds import Thresholds
from exporter.conftest import MakeClient
from exporter.factory import T0, body, gpu, record, stats, totals, watch

URL = "/api/v1/ingest"


def _samples(client: TestClient) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of one scrape."""
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def _labels(rank: int = 0, node: str = "node0", **extra: str) -> frozenset:
    return frozenset(
        {"run": "run-a", "node": node, "rank": str(rank), "local_rank": str(rank), **extra}.items()
    )


_JOB = {"world_size": "2", "job_id": ""}
"""The job labels of ``ampscope_rank_info`` for the factory's records (no job id)."""


def _device(rank: int = 0, node: str = "node0") -> dict[str, str]:
    """The device labels of ``ampscope_rank_info`` for a record that names no device."""
    return {"device": f"{node}:{rank}", "pci_bus_id": "", "hostname": ""}


def _post(client: TestClient, *records, dropped: int = 0) -> None:
    response = client.post(URL, content=body(*records, dropped=dropped))
    assert response.status_code == 200, response.text


def _rich_totals(steps: int, aligned: tuple[int, float] | None = None) -> object:
    return totals(
        steps,
        skipped=3,
        backoffs=3,
        growths=1,
        local={"cuda:0": 2, "cuda:1": 1},
        origin={"cuda:0": 1},
        params={"layers.0.attn.wo.weight": 4096, "blocks.0.ff[1].w{a=b,c}": 7},
        aligned=aligned,
        weather=WEATHER,
    )


WEATHER = WeatherTotals(skipped_steps=2, found_inf_local={"cuda:0": 2}, found_inf_origin={})
"""Two of ``_rich_totals``' three skips were the scaler's warm-up, both on cuda:0."""


def test_values_match_the_newest_record(make_client: MakeClient) -> None:
    client, clock = make_client()
    _post(client, record(1), dropped=1)
    newest = record(12, scale=8192.0, growth_tracker=5, total=_rich_totals(12, (10, 4096.0)))
    _post(client, newest, dropped=4)
    _post(client, record(5, time=T0 + 5), dropped=2)  # a late retry: no effect
    got = _samples(client)
    me = _labels()
    assert got[("ampscope_loss_scale", me)] == 8192.0
    assert got[("ampscope_growth_tracker", me)] == 5
    assert got[("ampscope_last_step", me)] == 12
    assert got[("ampscope_loss_scale_aligned", me)] == 4096.0
    assert got[("ampscope_loss_scale_aligned_step", me)] == 10
    assert unpack(got[("ampscope_loss_scale_aligned_packed", me)]) == (10, 4096.0)
    assert got[("ampscope_last_report_timestamp_seconds", me)] == clock.now
    assert got[("ampscope_rank_up", me)] == 1
    assert got[("ampscope_steps_total", me)] == 12
    assert got[("ampscope_skipped_steps_total", me)] == 3
    assert got[("ampscope_scale_backoffs_total", me)] == 3
    assert got[("ampscope_scale_growths_total", me)] == 1
    assert got[("ampscope_reporter_dropped_records_total", me)] == 4
    assert got[("ampscope_found_inf_total", _labels(device="cuda:0"))] == 2
    assert got[("ampscope_found_inf_total", _labels(device="cuda:1"))] == 1
    assert got[("ampscope_found_inf_origin_total", _labels(device="cuda:0"))] == 1
    assert got[("ampscope_nonfinite_grads_total", _labels(param="layers.0.attn.wo.weight"))] == 4096
    assert got[("ampscope_nonfinite_grads_total", _labels(param="blocks.0.ff[1].w{a=b,c}"))] == 7
    # A record without a setup comes from a reporter that predates it: an fp16 scaler.
    info = _labels(mode="scaler", policy="skip", grad_dtype="unknown", **_JOB, **_device())
    assert got[("ampscope_rank_info", info)] == 1
    assert got[("ampscope_nonfinite_updates_applied_total", me)] == 0
    assert got[("ampscope_exporter_tracked_runs", frozenset())] == 1
    assert got[("ampscope_exporter_tracked_ranks", frozenset())] == 1
    # ... and the weather part: its skips, and one per device of each found-inf counter.
    weather = 1 + 2 + 1
    assert got[("ampscope_exporter_tracked_series", frozenset())] == 18 + 3 + 2 + 1 + 2 + weather
    assert got[("ampscope_exporter_ingest_records_total", frozenset())] == 3


def test_aligned_scale_appears_from_the_first_aligned_step(make_client: MakeClient) -> None:
    client, _ = make_client()
    _post(client, record(9))
    got = _samples(client)
    assert ("ampscope_loss_scale_aligned", _labels()) not in got
    assert got[("ampscope_exporter_tracked_series", frozenset())] == 18 + 1
    _post(client, record(10, scale=512.0, total=totals(10, aligned=(10, 512.0))))
    got = _samples(client)
    assert got[("ampscope_loss_scale_aligned", _labels())] == 512.0
    assert got[("ampscope_loss_scale_aligned_step", _labels())] == 10
    assert unpack(got[("ampscope_loss_scale_aligned_packed", _labels())]) == (10, 512.0)
    assert got[("ampscope_exporter_tracked_series", frozenset())] == 18 + 3 + 1


def _watch_totals(steps: int) -> object:
    return totals(
        steps,
        local={"cuda:0": 3},
        origin={"cuda:0": 1},
        params={"layers.0.attn.wo.weight": 12},
        applied=3,
        first_applied=(steps - 2, True),
    )


def test_a_watch_rank_exposes_no_scale(make_client: MakeClient) -> None:
    client, _ = make_client()
    _post(client, watch(11, policy="observe", grad_dtype="bfloat16", total=_watch_totals(11)))
    _post(
        client,
        record(12, rank=1, scale=4096.0, total=totals(12, backoffs=2, aligned=(10, 4096.0))),
    )
    got = _samples(client)
    me, scaler = _labels(), _labels(rank=1)
    watch_info = _labels(mode="watch", policy="observe", grad_dtype="bfloat16", **_JOB, **_device())
    assert got[("ampscope_rank_info", watch_info)] == 1
    scaler_info = _labels(
        1, mode="scaler", policy="skip", grad_dtype="unknown", **_JOB, **_device(1)
    )
    assert got[("ampscope_rank_info", scaler_info)] == 1
    exposed = {name for name, labels in got if labels >= me}
    assert exposed & SCALER_ONLY == set()
    assert {name for name, labels in got if labels >= scaler} >= SCALER_ONLY
    assert got[("ampscope_nonfinite_updates_applied_total", me)] == 3
    assert got[("ampscope_last_step", me)] == 11
    assert got[("ampscope_steps_total", me)] == 11
    assert got[("ampscope_found_inf_total", _labels(device="cuda:0"))] == 3
    assert got[("ampscope_found_inf_origin_total", _labels(device="cuda:0"))] == 1
    assert got[("ampscope_nonfinite_grads_total", _labels(param="layers.0.attn.wo.weight"))] == 12
    assert got[("ampscope_nonfinite_updates_applied_total", scaler)] == 0


def test_tracked_series_count_what_is_exposed(make_client: MakeClient) -> None:
    client, _ = make_client()
    _post(client, watch(11, policy="skip", grad_dtype=None, total=_watch_totals(11)))
    _post(client, record(12, rank=1, total=_rich_totals(12, (10, 1024.0))))
    _post(client, record(7, rank=2, total=_rich_totals(7)))
    _post(client, watch(12, rank=3, policy="raise", grad_dtype="float32"))
    got = _samples(client)
    per_rank = [labels for name, labels in got if {n for n, _ in labels} >= set(RANK_LABELS)]
    assert got[("ampscope_exporter_tracked_series", frozenset())] == len(per_rank)
    assert got[
        (
            "ampscope_rank_info",
            _labels(mode="watch", policy="skip", grad_dtype="unknown", **_JOB, **_device()),
        )
    ]
    info = _labels(3, mode="watch", policy="raise", grad_dtype="float32", **_JOB, **_device(3))
    assert got[("ampscope_rank_info", info)] == 1


def test_loss_norms_and_spike_counts(make_client: MakeClient) -> None:
    client, _ = make_client()
    loss = [2.0 + 0.01 * (s % 5) for s in range(1, 31)]
    for rank in range(3):
        records = [
            record(s, rank=rank, world_size=3, stats=stats(loss[s - 1], 1.0, 1.0 + rank / 10))
            for s in range(1, 31)
        ]
        _post(client, *records)
    got = _samples(client)
    for rank in range(3):
        me = _labels(rank)
        assert got[("ampscope_loss", me)] == loss[29]
        assert got[("ampscope_grad_norm", me)] == 1.0
        assert got[("ampscope_grad_norm_origin", me)] == 1.0 + rank / 10
        for kind in ("loss", "grad_norm", "origin_outlier"):
            assert got[("ampscope_spikes_total", _labels(rank, kind=kind))] == 0
    # Step 31: rank 1's loss spikes, everyone's grad norm does, and rank 2's own gradients
    # stand out, which shows only once a third rank reported the step: the cached lines of
    # rank 2 must follow although its own newest record did not change.
    _post(client, record(31, rank=2, world_size=3, stats=stats(2.0, 50.0, 500.0)))
    _post(client, record(31, rank=0, world_size=3, stats=stats(2.0, 50.0, 1.0)))
    assert _samples(client)[("ampscope_spikes_total", _labels(2, kind="origin_outlier"))] == 0
    _post(client, record(31, rank=1, world_size=3, stats=stats(40.0, 50.0, 1.2)))
    got = _samples(client)
    counts = {
        (rank, kind): got[("ampscope_spikes_total", _labels(rank, kind=kind))]
        for rank in range(3)
        for kind in ("loss", "grad_norm", "origin_outlier")
    }
    assert counts == {
        (0, "loss"): 0, (0, "grad_norm"): 1, (0, "origin_outlier"): 0,
        (1, "loss"): 1, (1, "grad_norm"): 1, (1, "origin_outlier"): 0,
        (2, "loss"): 0, (2, "grad_norm"): 1, (2, "origin_outlier"): 1,
    }  # fmt: skip
    # An overflow iteration has no values: its gauges are absent until the next one.
    _post(client, record(32, rank=0, world_size=3, stats=stats(None, None, None)))
    got = _samples(client)
    assert ("ampscope_loss", _labels(0)) not in got
    assert got[("ampscope_spikes_total", _labels(0, kind="grad_norm"))] == 1
    per_rank = [labels for name, labels in got if {n for n, _ in labels} >= set(RANK_LABELS)]
    assert got[("ampscope_exporter_tracked_series", frozenset())] == len(per_rank)


def test_the_weather_part_is_exposed_for_every_device_of_its_counter(
    make_client: MakeClient,
) -> None:
    """The weather families repeat their full counters' label sets, 0 where no weather, so
    PromQL subtracts one from the other series by series; a reporter that predates the
    weather count exposes none (the rules then count everything)."""
    client, _ = make_client()
    _post(client, record(12, total=_rich_totals(12)))
    _post(client, record(12, rank=1, total=totals(12, skipped=3, origin={"cuda:0": 1})))
    got = _samples(client)
    assert got[("ampscope_weather_skipped_steps_total", _labels())] == 2
    local = "ampscope_weather_found_inf_total"
    assert got[(local, _labels(device="cuda:0"))] == 2
    assert got[(local, _labels(device="cuda:1"))] == 0
    assert got[("ampscope_weather_found_inf_origin_total", _labels(device="cuda:0"))] == 0
    old = {name for name, labels in got if labels >= _labels(1)}
    assert "ampscope_skipped_steps_total" in old
    assert not {name for name in old if name.startswith("ampscope_weather_")}


def test_every_catalogue_family_is_exposed_as_specified(client: TestClient) -> None:
    _post(client, record(12, total=_rich_totals(12, (10, 1024.0))))
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for spec in CATALOGUE:
        # The parser strips _total from counter family names.
        name = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
        family = families[name]
        assert family.type == spec.type, spec.name
        assert family.documentation == spec.help, spec.name
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                assert sorted(sample.labels) == sorted(spec.labels), spec.name
    assert len(families) == len(CATALOGUE)


def test_restart_resets_counters_and_silence_marks_rank_down(make_client: MakeClient) -> None:
    client, clock = make_client(stale_after_s=60)
    _post(client, record(40, total=totals(40, skipped=10)), dropped=7)
    clock.advance(500)
    _post(client, record(2, time=T0 + 500, total=totals(2, skipped=1)))  # the process restarted
    got = _samples(client)
    assert got[("ampscope_steps_total", _labels())] == 2
    assert got[("ampscope_skipped_steps_total", _labels())] == 1
    assert got[("ampscope_reporter_dropped_records_total", _labels())] == 0
    clock.advance(60)
    assert _samples(client)[("ampscope_rank_up", _labels())] == 1
    clock.advance(1)
    assert _samples(client)[("ampscope_rank_up", _labels())] == 0


def test_the_health_thresholds_are_published_as_set(make_client: MakeClient) -> None:
    client, _ = make_client(stale_after_s=30, lost_critical_share=0.5, skip_storm_min_steps=4)
    got = _samples(client)  # before any rank reported: the exporter's own, always there
    published = {
        dict(labels)["threshold"]: value
        for (name, labels), value in got.items()
        if name == "ampscope_exporter_health_threshold"
    }
    t = Thresholds(stale_after_s=30, lost_critical_share=0.5, skip_storm_min_steps=4)
    assert published == {f.name: float(getattr(t, f.name)) for f in fields(t)}
    assert (published["stale_after_s"], published["lost_critical_share"]) == (30.0, 0.5)
    assert published["skip_storm_min_steps"] == 4.0
    assert published["stall_after_s"] == 600.0


@pytest.mark.prometheus
def test_promtool_accepts_the_exposition(make_client: MakeClient) -> None:
    need_tool("promtool")  # skips before any work when it is missing
    client, _ = make_client()
    for rank in range(3):
        _post(client, record(7, rank=rank, node=f"n{rank}", total=_rich_totals(7)), dropped=rank)
    _post(client, watch(9, rank=3, node="n3", total=_watch_totals(9)))
    text = client.get("/metrics").text
    lint = promtool_check_metrics(text)
    assert lint == "", lint  # no lint warnings either


def test_rank_info_names_the_device_the_process_said(make_client: MakeClient) -> None:
    client, _ = make_client()
    # The first record of a process carries the device, later ones do not: it stays.
    _post(client, record(1, device=gpu(3)), record(2))
    # A rank whose first record the exporter never saw (it restarted, or the batch was
    # lost) learns it from the device the reporter repeats on every batch.
    response = client.post(URL, content=body(record(5, rank=1), device=gpu(4, host="host-b")))
    assert response.status_code == 200, response.text
    _post(client, record(5, rank=2))  # a reporter that predates the field
    got = _samples(client)
    job = {"mode": "scaler", "policy": "skip", "grad_dtype": "unknown", **_JOB}
    assert (
        got[
            (
                "ampscope_rank_info",
                _labels(
                    **job,
                    device="GPU-00000003-0000-0000-0000-00000000abcd",
                    pci_bus_id="00000000:1B:00.0",
                    hostname="host-a",
                ),
            )
        ]
        == 1
    )
    assert (
        got[
            (
                "ampscope_rank_info",
                _labels(
                    1,
                    **job,
                    device="GPU-00000004-0000-0000-0000-00000000abcd",
                    pci_bus_id="00000000:1C:00.0",
                    hostname="host-b",
                ),
            )
        ]
        == 1
    )
    assert got[("ampscope_rank_info", _labels(2, **job, **_device(2)))] == 1


def _device_samples(client: TestClient) -> dict[tuple[str, ...], float]:
    """{(family, run, device, node[, kind]): value} of the per-device families."""
    out = {}
    for (name, labels), value in _samples(client).items():
        if name.startswith("ampscope_device_"):
            named = dict(labels)
            key = (name, named["run"], named["device"], named["node"])
            out[(*key, named["kind"]) if "kind" in named else key] = value
    return out


def test_device_offences_count_origins_and_outliers(make_client: MakeClient) -> None:
    client, _ = make_client()
    # Rank 0 (GPU 0) is the origin of inf/NaN at steps 4 and 9; rank 1 never is.
    for rank in range(2):
        records = [
            record(
                s,
                rank=rank,
                origin=rank == 0 and s in (4, 9),
                total=totals(s, origin={"cuda:0": (s >= 4) + (s >= 9) if rank == 0 else 0}),
                device=gpu(rank) if s == 1 else None,
            )
            for s in range(1, 11)
        ]
        _post(client, *records)
    got = _device_samples(client)
    dev0 = "GPU-00000000-0000-0000-0000-00000000abcd"
    assert got == {
        ("ampscope_device_offences_total", "run-a", dev0, "node0", "nonfinite_origin"): 2,
        ("ampscope_device_last_offence_timestamp_seconds", "run-a", dev0, "node0"): T0 + 9,
    }


def _uneven_run(client: TestClient, run: str) -> None:
    """Three ranks on their own devices; at step 11 rank 2's own gradients stand out (its
    origin norm 33x the others', as an epoch's 1-sample remainder batch makes it)."""
    for rank in range(3):
        records = [
            record(s, run=run, rank=rank, world_size=3, stats=stats(1.0, 1.0, 1.0),
                   device=gpu(rank) if s == 1 else None)
            for s in range(1, 11)
        ]  # fmt: skip
        records.append(
            record(11, run=run, rank=rank, world_size=3,
                   stats=stats(1.0, 1.0, 33.0 if rank == 2 else 1.0))
        )  # fmt: skip
        _post(client, *records)


def test_an_origin_outlier_is_a_spike_and_no_offence_of_its_device(
    make_client: MakeClient,
) -> None:
    # Uneven per-rank batches make a healthy rank's own norm stand out: an outlier norm
    # alone cannot tell its device from its data, so two such runs must not accuse the GPU.
    client, _ = make_client()
    for run in ("uneven-0", "uneven-1"):
        _uneven_run(client, run)
    spikes = {
        (dict(labels)["run"], dict(labels)["rank"]): value
        for (name, labels), value in _samples(client).items()
        if name == "ampscope_spikes_total" and dict(labels)["kind"] == "origin_outlier"
    }
    assert spikes == {(run, str(rank)): float(rank == 2)
                      for run in ("uneven-0", "uneven-1") for rank in range(3)}  # fmt: skip
    assert _device_samples(client) == {}


def test_device_offences_sum_ranks_sharing_a_device(make_client: MakeClient) -> None:
    client, _ = make_client()
    # Ranks 1 and 2 of run-b share one GPU; at step 11 rank 2's own gradients stand out
    # (its origin norm 100x the others': no offence), at step 11 rank 2's and at step 12
    # rank 1's gradients hold inf.
    for rank in range(3):
        shared = gpu(7) if rank else gpu(0)
        records = [
            record(s, run="run-b", rank=rank, world_size=3, stats=stats(1.0, 1.0, 1.0),
                   device=shared if s == 1 else None)
            for s in range(1, 11)
        ]  # fmt: skip
        records.append(
            record(11, run="run-b", rank=rank, world_size=3, origin=rank == 2,
                   stats=stats(1.0, 1.0, 100.0 if rank == 2 else 1.0),
                   total=totals(11, origin={"cuda:0": int(rank == 2)}))
        )  # fmt: skip
        _post(client, *records)
    _post(
        client,
        record(12, run="run-b", rank=1, world_size=3, origin=True, time=T0 + 50,
               total=totals(12, origin={"cuda:0": 1})),
    )  # fmt: skip
    got = _device_samples(client)
    shared = "GPU-00000007-0000-0000-0000-00000000abcd"
    assert got == {
        ("ampscope_device_offences_total", "run-b", shared, "node0", "nonfinite_origin"): 2,
        # The newest of the two ranks' offences: rank 1's inf at T0 + 50.
        ("ampscope_device_last_offence_timestamp_seconds", "run-b", shared, "node0"): T0 + 50,
    }


def _rerun(*, flagged: bool, reproduced: bool) -> Rerun:
    """A rerun of a non-finite iteration as the rank reports it (``Rerun`` of the record)."""
    return Rerun(
        reason="nonfinite",
        flagged=flagged,
        reproduced=reproduced,
        first=RerunPass(loss=1.0, norm=None, nonfinite=flagged),
        second=RerunPass(loss=1.0, norm=None if reproduced else 2.0, nonfinite=reproduced),
    )


def test_a_transient_rerun_is_an_offence_of_the_device_and_a_reproduced_one_is_not(
    make_client: MakeClient,
) -> None:
    client, _ = make_client()
    # Run "rr" on one node: every rank reran steps 4 and 7. At step 4 rank 1's own result
    # (a NaN sample) came back on the rerun: the record keeps the second pass, whose own
    # gradients held inf/NaN again, so the origin counter counts it, yet it is the data's.
    # At step 7 rank 0's own result did not come back: its device.
    for rank in range(2):
        records = []
        for s in range(1, 10):
            rerun = None
            if s in (4, 7):
                flagged = (rank, s) in ((1, 4), (0, 7))
                rerun = _rerun(flagged=flagged, reproduced=s == 4)
            data_nan = rank == 1 and s >= 4
            records.append(
                record(
                    s,
                    run="rr",
                    rank=rank,
                    origin=rank == 1 and s == 4,
                    skipped=s == 4,
                    rerun=rerun,
                    total=totals(s, origin={"cuda:0": int(data_nan)}),
                    device=gpu(rank) if s == 1 else None,
                )
            )
        _post(client, *records)
    got = _device_samples(client)
    dev0 = "GPU-00000000-0000-0000-0000-00000000abcd"
    assert got == {
        ("ampscope_device_offences_total", "rr", dev0, "node0", "transient_fault"): 1,
        ("ampscope_device_last_offence_timestamp_seconds", "rr", dev0, "node0"): T0 + 7,
    }
    # The reruns themselves are counted per rank, both results.
    samples = _samples(client)
    reruns = {
        (dict(labels)["rank"], dict(labels)["result"]): value
        for (name, labels), value in samples.items()
        if name == "ampscope_reruns_total"
    }
    assert reruns == {("0", "transient"): 1, ("1", "reproducible"): 1}

    # A later own inf/NaN of rank 1 without a rerun is an offence of its device again; the
    # reproduced step stays left out.
    _post(
        client,
        record(10, run="rr", rank=1, origin=True, time=T0 + 40,
               total=totals(10, origin={"cuda:0": 2})),
    )  # fmt: skip
    dev1 = "GPU-00000001-0000-0000-0000-00000000abcd"
    got = _device_samples(client)
    assert got[("ampscope_device_offences_total", "rr", dev1, "node0", "nonfinite_origin")] == 1
    assert got[("ampscope_device_last_offence_timestamp_seconds", "rr", dev1, "node0")] == T0 + 40
    assert ("ampscope_device_offences_total", "rr", dev1, "node0", "transient_fault") not in got


def test_every_offence_kind_is_catalogued(make_client: MakeClient) -> None:
    client, _ = make_client()
    # One rank offends in all four ways: its own inf at step 3, a transient rerun at
    # step 5, its replicas outvote it at step 10, and an origin outlier at step 25 (after
    # the spike rule's window).
    outvoted = ReplicaCheckResult(agree=False, replicas=3, ranks=[0], parameters=["w"])
    for rank in range(3):
        records = []
        for s in range(1, 26):
            own = rank == 0
            records.append(
                record(
                    s, run="all", rank=rank, world_size=3, origin=own and s == 3,
                    rerun=_rerun(flagged=own, reproduced=False) if s == 5 else None,
                    replicas=outvoted if s == 10 else None,
                    stats=stats(1.0, 1.0, 100.0 if own and s == 25 else 1.0),
                    total=totals(s, origin={"cuda:0": int(own and s >= 3)}),
                    device=gpu(rank) if s == 1 else None,
                )
            )  # fmt: skip
        _post(client, *records)
    kinds = {key[4] for key in _device_samples(client) if len(key) == 5}
    assert kinds == set(OFFENCE_KINDS)


def test_a_restarted_rank_names_its_new_device(make_client: MakeClient) -> None:
    client, _ = make_client()
    _post(client, record(1, device=gpu(0)), record(10))
    # A new process (step 1 again, later) on another GPU of another host.
    _post(client, record(1, time=T0 + 100, device=gpu(5, host="host-b")))
    got = _samples(client)
    infos = [dict(labels) for name, labels in got if name == "ampscope_rank_info"]
    assert [(i["device"], i["hostname"]) for i in infos] == [
        ("GPU-00000005-0000-0000-0000-00000000abcd", "host-b")
    ]
