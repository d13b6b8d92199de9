"""The exporter's ``skip_storm`` and ``inf_hotspot`` over records as a rank sends them: the
fault rule's weather (a warm-up from a high ``init_scale``, growth probes) counted apart in
``totals.weather`` and left out, what is left counted, and reporters that predate the count
judged as before."""

from __future__ import annotations

from collections.abc import Mapping

from ampscope.exporter.health import evaluate
from ampscope.exporter.state.store import Store, StoreLimits
from ampscope.reporter.fault_rule import FaultState, Iteration
from ampscope.reporter.schema import StepRecord, WeatherTotals
from ampscope.verdicts.thresholds import Thresholds
from exporter.factory import T0, batch, record, totals, watch

LIMITS = StoreLimits(
    window_s=600.0, max_runs=4, max_ranks_per_run=64, max_series=100_000, history_length=1000
)


def _fp16_rank(
    found: list[Mapping[str, bool]], *, step_s: float, weather: bool = True, rank: int = 0
) -> list[StepRecord]:
    """The records of one fp16 rank under torch's GradScaler (init_scale 2**16, growth
    interval 2000): ``found[i]`` is step i+1's found-inf per device (a skip and a backoff when
    any). The weather comes from the real fault rule, fed each step as the rank's telemetry
    thread feeds it; ``weather=False``: a reporter that predates the count."""
    rule = FaultState()
    scale, tracker = 65536.0, 0
    skipped_total = 0
    local: dict[str, int] = {}
    w_skipped, w_local = 0, {}
    records = []
    for i, flags in enumerate(found):
        step = i + 1
        overflow = any(flags.values())
        before = scale
        if overflow:
            scale, tracker = scale / 2, 0
        else:
            tracker += 1
        call = rule.observe(
            Iteration(
                scaler=True,
                nonfinite=overflow,
                scale_before=before,
                scale_after=scale,
                growth_tracker=tracker,
            )
        )
        skipped_total += overflow
        for device, flag in flags.items():
            local[device] = local.get(device, 0) + flag
            if call is not None and call.cls == "weather":
                w_local[device] = w_local.get(device, 0) + flag
        if call is not None and call.cls == "weather":
            w_skipped += 1
        counted = WeatherTotals(
            skipped_steps=w_skipped, found_inf_local=dict(w_local), found_inf_origin={}
        )
        rec = record(
            step,
            rank=rank,
            world_size=1,
            local_world_size=1,
            time=T0 + step_s * step,
            scale=scale,
            scale_before=before,
            skipped=overflow,
            total=totals(
                step,
                skipped=skipped_total,
                backoffs=skipped_total,
                local=dict(local),
                weather=counted if weather else None,
            ),
        )
        records.append(rec.model_copy(update={"found_inf_local": dict(flags)}))
    return records


def _unhealthy(records: list[StepRecord]) -> dict[str, str]:
    """The rules not ok, by name, just after the last record arrived (each arrives at its
    own time)."""
    store = Store(LIMITS)
    for rec in records:
        store.ingest(batch(rec), now=rec.time)
    report = evaluate("run-a", store.ranks("run-a"), records[-1].time, Thresholds())
    return {v.rule: v.summary for v in report.verdicts if v.status != "ok"}


def _warmup(n: int, backoffs: int) -> list[Mapping[str, bool]]:
    """One device, ``backoffs`` warm-up overflows then clean steps: ``n`` steps in all."""
    return [{"cuda:0": step < backoffs} for step in range(n)]


def test_a_slow_fp16_warm_up_is_no_skip_storm_but_a_storm_after_it_is() -> None:
    # 30 s steps (a big model): 10 steps fill the 5-minute window, 3 of them warm-up backoffs.
    assert _unhealthy(_fp16_rank(_warmup(10, 3), step_s=30)) == {}
    # After the warm-up settled, 4 of the window's 10 steps overflow: the first one backoff
    # below the warm-up's last overflow (the scaler's edge: weather), the 3 others below
    # that, at the clean scale: faults.
    found = _warmup(20, 3) + [{"cuda:0": step % 3 == 0} for step in range(10)]
    records = _fp16_rank(found, step_s=30)
    assert records[-1].totals.weather == WeatherTotals(
        skipped_steps=4, found_inf_local={"cuda:0": 4}, found_inf_origin={}
    )
    assert _unhealthy(records)["skip_storm"].startswith(
        "3 of rank 0's last 10 steps were skipped (30%)"
    )


def test_a_reporter_without_the_weather_count_counts_every_skip_as_before() -> None:
    records = _fp16_rank(_warmup(10, 3), step_s=30, weather=False)
    assert _unhealthy(records)["skip_storm"] == (
        "3 of rank 0's last 10 steps were skipped (30%) on 1 rank(s), not counting the loss "
        "scaler's weather"
    )


def test_a_watch_has_no_weather_every_skip_counts() -> None:
    # A GradWatch under skip: the fault rule calls every skip a fault, the weather stays 0.
    none = WeatherTotals(skipped_steps=0, found_inf_local={}, found_inf_origin={})
    records = [
        watch(
            s,
            policy="skip",
            skipped=s > 7,
            time=T0 + 30 * s,
            total=totals(s, skipped=max(0, s - 7), weather=none),
        )
        for s in range(1, 11)
    ]
    assert _unhealthy(records)["skip_storm"].startswith("3 of rank 0's last 10")


def test_a_model_over_two_gpus_warming_up_is_no_hotspot_but_a_faulty_device_is() -> None:
    # One process, the model split over cuda:0 (embedding, first blocks) and cuda:1 (last
    # blocks, head): 6 warm-up backoffs, each overflowing in cuda:1's gradients, in cuda:0's
    # only at the first (2**16). All weather.
    warm = [{"cuda:0": step == 0, "cuda:1": step < 6} for step in range(60)]
    assert _unhealthy(_fp16_rank(warm, step_s=1)) == {}
    # The same warm-up from a reporter without the weather count: the hotspot, as before.
    old = _unhealthy(_fp16_rank(warm, step_s=1, weather=False))
    assert old["inf_hotspot"] == "rank 0 device cuda:1 holds 86% of 7 local found-inf detections"
    # After the warm-up, cuda:1 overflows every 8th step: the first at the scaler's edge
    # (weather), the 5 others at the clean scale (faults).
    faulty = warm + [{"cuda:0": False, "cuda:1": step % 8 == 0} for step in range(48)]
    hot = _unhealthy(_fp16_rank(faulty, step_s=1))
    assert hot["inf_hotspot"] == "rank 0 device cuda:1 holds 100% of 5 local found-inf detections"
