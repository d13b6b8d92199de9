"""Ordering, duplicates, restarts and history of one rank's state."""

from __future__ import annotations

from ampscope.exporter.state.ranks import RankState, SkipEvent, series_of
from ampscope.reporter.schema import StepRecord, WeatherTotals
from exporter.factory import T0, record, steps, totals, watch


def _state(history_length: int = 100) -> RankState:
    return RankState(history_length=history_length)


def test_in_order_batches_advance_newest_and_history() -> None:
    state = _state()
    assert state.apply_batch(steps(1, 3), 0, now=10.0) == (3, 0)
    assert state.apply_batch(steps(4, 5), 2, now=11.0) == (2, 0)
    assert state.newest is not None
    assert state.newest.step == 5
    assert [r.step for r in state.history] == [1, 2, 3, 4, 5]
    assert state.last_report == 11.0
    assert state.dropped_records == 2
    assert state.first_step == 1
    assert [s.received for s in state.samples] == [10.0, 11.0]
    assert state.samples[-1].counts.steps == 5


def test_history_gives_records_back_whole() -> None:
    state = _state()
    sent = [
        record(1, total=totals(1, local={"cuda:0": 0, "cuda:1": 0})),
        record(2, scale=32768.0, skipped=True, total=totals(2, skipped=1, params={"w": 3})),
    ]
    state.apply_batch(sent, 0, now=10.0)
    held = list(state.history)
    assert [(h.step, h.time, h.scale_after) for h in held] == [
        (r.step, r.time, r.scale_after) for r in sent
    ]
    assert [h.record() for h in held] == sent


def test_late_retry_fills_history_without_moving_newest() -> None:
    state = _state()
    state.apply_batch(steps(4, 6), 3, now=10.0)
    # The batch that failed before 4..6 got through arrives now, with an older drop count.
    assert state.apply_batch(steps(1, 3), 1, now=11.0) == (3, 0)
    assert state.newest is not None
    assert state.newest.step == 6
    assert [r.step for r in state.history] == [1, 2, 3, 4, 5, 6]
    assert state.dropped_records == 3  # cumulative: a late batch never lowers it
    assert state.restarts == 0
    assert len(state.samples) == 1  # the late batch added nothing to the windows


def test_duplicates_are_ignored() -> None:
    state = _state()
    state.apply_batch(steps(1, 4), 0, now=10.0)
    assert state.apply_batch(steps(3, 4), 0, now=11.0) == (0, 2)
    assert [r.step for r in state.history] == [1, 2, 3, 4]
    assert state.last_report == 10.0  # nothing new: not a sign of life of a new step


def test_lower_step_produced_later_is_a_restart() -> None:
    state = _state()
    state.apply_batch(steps(1, 50), 4, now=T0 + 60)
    restarted = [record(s, time=T0 + 100 + s) for s in (1, 2)]
    assert state.apply_batch(restarted, 0, now=T0 + 110) == (2, 0)
    assert state.newest is not None
    assert state.newest.step == 2
    assert state.newest.totals.steps == 2  # counters restart with the process
    assert state.restarts == 1
    assert state.dropped_records == 0  # the new reporter's count, not the dead one's
    assert [r.step for r in state.history] == [1, 2]
    # A retry from the dead process (produced before its last record) changes nothing.
    assert state.apply_batch([record(51, time=T0 + 51)], 9, now=T0 + 111) == (0, 1)
    assert state.newest.step == 2
    assert state.dropped_records == 0


def test_higher_step_with_fallen_counters_is_a_restart() -> None:
    state = _state()
    state.apply_batch([record(10, total=totals(10, skipped=6))], 0, now=10.0)
    state.apply_batch([record(20, time=T0 + 100, total=totals(20, skipped=1))], 0, now=11.0)
    assert state.restarts == 1
    assert [r.step for r in state.history] == [20]
    assert state.first_step == 20


def test_a_fallen_weather_count_is_a_restart() -> None:
    # The full counters held (the warm-up of a new process repeated the old one's skips),
    # but the weather part fell: a process that counted afresh.
    def warm(weather: int) -> WeatherTotals:
        return WeatherTotals(
            skipped_steps=weather, found_inf_local={"cuda:0": weather}, found_inf_origin={}
        )

    state = _state()
    state.apply_batch([record(10, total=totals(10, skipped=6, weather=warm(6)))], 0, 10.0)
    state.apply_batch([record(11, total=totals(11, skipped=6, weather=warm(6)))], 0, 11.0)
    assert state.restarts == 0
    later = record(20, time=T0 + 100, total=totals(20, skipped=6, weather=warm(3)))
    state.apply_batch([later], 0, now=12.0)
    assert state.restarts == 1


def test_history_is_bounded_and_stays_sorted() -> None:
    state = _state(history_length=4)
    state.apply_batch(steps(3, 8), 0, now=10.0)
    assert [r.step for r in state.history] == [5, 6, 7, 8]
    # Older than everything a full history keeps: not inserted.
    assert state.apply_batch([record(2)], 0, now=11.0) == (0, 1)
    state.apply_batch(steps(10, 10), 0, now=12.0)
    state.apply_batch([record(9)], 0, now=13.0)
    assert [r.step for r in state.history] == [7, 8, 9, 10]


def test_window_samples_trim_to_one_baseline() -> None:
    state = _state()
    for i in range(1, 6):
        state.apply_batch([record(i)], 0, now=float(i * 100))
    state.trim_samples(keep_after=350.0)
    # 300 is the newest sample at or before 350: the baseline of a window starting there.
    assert [s.received for s in state.samples] == [300.0, 400.0, 500.0]


def test_series_of_counts_every_label_set() -> None:
    rec = record(
        1, total=totals(1, local={"cuda:0": 0, "cuda:1": 1}, origin={"cuda:0": 1}, params={"w": 3})
    )
    assert series_of(rec) == 18 + 2 + 1 + 1


def test_series_of_a_watch_rank_counts_no_scale() -> None:
    rec = watch(1, total=totals(1, local={"cuda:0": 0}, params={"w": 3}, aligned=(10, 1.0)))
    # No scale, growth tracker, backoffs, growths, nor aligned scale: 18 - 4.
    assert series_of(rec) == 14 + 1 + 1


def test_non_finite_updates_applied_falling_is_a_restart() -> None:
    state = _state()
    state.apply_batch([watch(10, total=totals(10, applied=3, first_applied=(8, None)))], 0, 10.0)
    state.apply_batch([watch(20, time=T0 + 100, total=totals(20))], 0, now=11.0)
    assert state.restarts == 1
    assert state.newest is not None
    assert state.newest.totals.first_nonfinite_applied is None


def test_the_newest_skipped_step_is_kept_with_its_origin_until_a_restart() -> None:
    def skip(step: int, own: dict[str, bool], time: float | None = None) -> StepRecord:
        rec = watch(step, policy="skip", skipped=True, found_inf=True, time=time)
        return rec.model_copy(update={"found_inf_origin": own})

    state = RankState(history_length=64)
    state.apply_batch([watch(1, policy="skip"), skip(2, {"cuda:0": True})], 0, T0)
    assert state.snapshot().last_skip == SkipEvent(2, True, T0)
    state.apply_batch([skip(6, {"cuda:0": False}), watch(7, policy="skip")], 0, T0 + 5)
    # A late retry of an older skipped step does not move it back.
    state.apply_batch([skip(4, {"cuda:0": True})], 0, T0 + 6)
    assert state.snapshot().last_skip == SkipEvent(6, False, T0 + 5)
    # Origin tracking off: no origin known.
    state.apply_batch([skip(8, {})], 0, T0 + 7)
    assert state.snapshot().last_skip == SkipEvent(8, None, T0 + 7)
    # A new process starts without one.
    state.apply_batch([watch(1, policy="skip", time=T0 + 100)], 0, T0 + 100)
    assert state.restarts == 1
    assert state.snapshot().last_skip is None
