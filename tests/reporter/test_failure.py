"""How a rank's end is told: the exception training ended on, on the final heartbeat.

In-process for what the reporter decides, real processes for the interpreter's hooks (an
uncaught exception, a thread's, a hook replaced by a library), against the loopback
exporter, which validates every heartbeat with the real schema.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loopback_server import LoopbackExporter, make_record
from support import DEADLOCK_GUARD_S

from ampscope.rank.frontends.stop import NonFiniteGradientsError
from ampscope.reporter import failure
from ampscope.reporter.http import HttpReporter
from ampscope.reporter.schema import MAX_FAILURE_MESSAGE, RankFailure

FAST = {"retry_initial": 0.02, "retry_max": 0.1, "timeout": 2.0, "flush_interval": 0.05}
SCRIPT = Path(__file__).parent / "failing_rank.py"


def _stop_error(step: int = 5, origin: tuple[int, ...] | None = (1,)) -> NonFiniteGradientsError:
    return NonFiniteGradientsError(
        f"ampscope: non-finite gradients at step {step}: policy 'raise' stops",
        step=step,
        origin_ranks=origin,
        local_ranks=(0, 1),
        params=(),
    )


def test_a_non_finite_stop_is_told_with_its_step_and_origin_even_when_wrapped() -> None:
    try:
        try:
            raise _stop_error()
        except NonFiniteGradientsError as exc:
            raise RuntimeError("training diverged") from exc
    except RuntimeError as wrapped:
        noted = failure.describe(wrapped, "uncaught")
    assert noted.failure(newest_step=4) == RankFailure(
        kind="nonfinite_gradients",
        exception="NonFiniteGradientsError",
        message="ampscope: non-finite gradients at step 5: policy 'raise' stops",
        step=5,
        origin_ranks=[1],
        seen_by="uncaught",
    )
    # Any other exception: its class and message, at the newest step reported.
    other = failure.describe(KeyError("x" * 2000), "with")
    told = other.failure(newest_step=4)
    assert (told.kind, told.exception, told.step, told.origin_ranks) == (
        "exception",
        "KeyError",
        4,
        None,
    )
    assert len(told.message) == MAX_FAILURE_MESSAGE
    assert told.message.endswith("…")
    untracked = failure.describe(_stop_error(origin=None), "watch").failure(newest_step=5)
    assert untracked.origin_ranks is None


def test_only_a_step_reported_after_the_exception_voids_it() -> None:
    noted = failure.describe(ValueError("x"), "watch")
    assert failure.void_after(noted, None) is noted
    assert failure.void_after(noted, noted.time - 1.0) is noted  # the step it stopped at
    assert failure.void_after(noted, noted.time + 1.0) is None  # training went on
    uncaught = failure.describe(ValueError("x"), "uncaught")
    assert failure.void_after(uncaught, uncaught.time + 1.0) is uncaught  # the process ends


def test_close_after_a_noted_error_ends_the_rank_failed() -> None:
    with LoopbackExporter() as exporter:
        reporter = HttpReporter(exporter.url, **FAST)
        for step in (1, 2, 3):
            reporter.emit(make_record(step))
        assert reporter.flush(timeout=DEADLOCK_GUARD_S)
        # What GradWatch does as it raises; the loop catches it and the script ends.
        failure.note(_stop_error(step=3, origin=()))
        reporter.close(timeout=DEADLOCK_GUARD_S)
        final = exporter.heartbeats[-1]
        assert (final.final, final.step) == (True, 3)
        assert final.failure is not None
        assert (final.failure.exception, final.failure.step, final.failure.origin_ranks) == (
            "NonFiniteGradientsError",
            3,
            [],
        )
        assert final.failure.seen_by == "watch"
        assert exporter.events.count("final") == 1


def test_a_step_after_the_noted_error_ends_the_rank_finished() -> None:
    with LoopbackExporter() as exporter:
        reporter = HttpReporter(exporter.url, **FAST)
        reporter.emit(make_record(1))
        failure.note(_stop_error(step=1))  # caught; a checkpoint restored; training goes on
        time.sleep(0.01)  # the next step comes later, on any clock resolution
        reporter.emit(make_record(2).model_copy(update={"time": time.time()}))
        reporter.close(timeout=DEADLOCK_GUARD_S)
        final = exporter.heartbeats[-1]
        assert (final.final, final.step, final.failure) == (True, 2, None)


def test_a_with_block_left_by_an_exception_ends_the_rank_failed_and_re_raises() -> None:
    with LoopbackExporter() as exporter:

        def one_step_then_disk_full() -> None:
            with HttpReporter(exporter.url, **FAST) as rep:
                rep.emit(make_record(1))
                assert rep.flush(timeout=DEADLOCK_GUARD_S)
                raise OSError("disk full")

        with pytest.raises(OSError, match="disk full"):
            one_step_then_disk_full()
        final = exporter.heartbeats[-1]
        assert final.failure is not None
        assert (final.failure.exception, final.failure.message) == ("OSError", "disk full")
        assert (final.failure.seen_by, final.failure.step) == ("with", 1)
        # A block that ends normally: finished.
        failure.forget()
        with HttpReporter(exporter.url, **FAST) as rep:
            rep.emit(make_record(1, rank=1))
        assert exporter.heartbeats[-1].failure is None
        assert exporter.heartbeats[-1].final


@pytest.mark.parametrize(
    ("status", "failed"),
    [
        ((), None),
        ((0,), None),
        ((3,), ("SystemExit", "3")),
        (("requeue failed",), ("SystemExit", "requeue failed")),
    ],
    ids=["exit", "exit-0", "exit-3", "exit-message"],
)
def test_sys_exit_in_a_with_block_fails_the_rank_only_on_a_failing_status(
    status: tuple[object, ...], failed: tuple[str, str] | None
) -> None:
    # A requeue or preemption handler saves its checkpoint and calls sys.exit(0) inside the
    # recommended `with` block: a normal end, which must not page AmpscopeRankFailed.
    with LoopbackExporter() as exporter:
        failure.forget()

        def one_step_then_leave() -> None:
            with HttpReporter(exporter.url, **FAST) as rep:
                rep.emit(make_record(1))
                assert rep.flush(timeout=DEADLOCK_GUARD_S)
                sys.exit(*status)

        with pytest.raises(SystemExit):
            one_step_then_leave()
        final = exporter.heartbeats[-1]
        assert final.final
        if failed is None:
            assert final.failure is None
        else:
            assert final.failure is not None
            assert (final.failure.exception, final.failure.message) == failed
            assert final.failure.seen_by == "with"
        failure.forget()


class TrialPruned(Exception):
    """Optuna's exception (optuna.exceptions.TrialPruned), by the name ampscope knows it by:
    Optuna is not a dependency."""


TrialPruned.__module__ = "optuna.exceptions"


class PrunedHere(TrialPruned):
    """A library's own subclass of it (a pruning callback's)."""


@pytest.mark.parametrize(
    ("exc", "failed"),
    [
        (TrialPruned("trial 3 pruned at step 40"), False),
        (PrunedHere(), False),
        (KeyError("TrialPruned"), True),
    ],
    ids=["pruned", "subclass", "another"],
)
def test_a_sweep_pruning_its_trial_ends_the_rank_finished(exc: Exception, failed: bool) -> None:
    # Optuna's pruner stops most trials of a sweep this way: each must not page
    # AmpscopeRankFailed.
    with LoopbackExporter() as exporter:
        failure.forget()

        def one_step_then_raise() -> None:
            with HttpReporter(exporter.url, **FAST) as rep:
                rep.emit(make_record(1))
                assert rep.flush(timeout=DEADLOCK_GUARD_S)
                raise exc

        with pytest.raises(type(exc)):
            one_step_then_raise()
        final = exporter.heartbeats[-1]
        assert final.final
        assert (final.failure is not None) == failed
        failure.forget()


def test_an_exception_after_the_rank_closed_is_not_kept_for_a_later_one() -> None:
    # The Trainer closes its front-end at on_train_end, and an exception may still leave
    # train() after it (a sweep's pruner, a callback's own): the rank said finished, and a
    # later front-end in the process must not end on that exception.
    import ampscope

    with LoopbackExporter() as exporter:
        failure.forget()
        watch = ampscope.GradWatch("observe", reporter=None)

        def closed_then_raise() -> None:
            with watch, HttpReporter(exporter.url, **FAST) as rep:
                rep.emit(make_record(1))
                assert rep.flush(timeout=DEADLOCK_GUARD_S)
                rep.close(DEADLOCK_GUARD_S)
                watch.close()
                raise RuntimeError("after the end")

        with pytest.raises(RuntimeError):
            closed_then_raise()
        assert exporter.heartbeats[-1].failure is None
        assert failure.noted() is None
        # Not closed yet: the block's exit ends the rank failed, as before.
        watch = ampscope.GradWatch("observe", reporter=None)
        with pytest.raises(RuntimeError), watch:
            raise RuntimeError("during training")
        noted = failure.noted()
        assert noted is not None
        assert noted.failure(1).message == "during training"
        failure.forget()


def _run(exporter: LoopbackExporter, mode: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), exporter.url, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLOCK_GUARD_S * 2,
        check=False,
    )


def _finals(exporter: LoopbackExporter) -> list[RankFailure | None]:
    return [beat.failure for beat in exporter.heartbeats if beat.final]


@pytest.mark.parametrize("mode", ["normal", "exit", "thread_other", "thread_then_steps"])
def test_a_process_that_ends_normally_says_finished(mode: str) -> None:
    with LoopbackExporter() as exporter:
        done = _run(exporter, mode)
        assert done.returncode == 0, done.stderr
        assert _finals(exporter) == [None], done.stderr
        if mode.startswith("thread"):
            assert "ZeroDivisionError" in done.stderr  # Python's own hook still printed it


def test_an_uncaught_exception_ends_the_rank_failed_and_still_prints_its_traceback() -> None:
    with LoopbackExporter() as exporter:
        done = _run(exporter, "uncaught")
        assert done.returncode == 1
        assert "Traceback" in done.stderr
        assert "RuntimeError: boom after step 3" in done.stderr
        (told,) = _finals(exporter)
        assert told == RankFailure(
            kind="exception",
            exception="RuntimeError",
            message="boom after step 3",
            step=3,
            origin_ranks=None,
            seen_by="uncaught",
        )


def test_a_hook_installed_before_still_runs() -> None:
    with LoopbackExporter() as exporter:
        done = _run(exporter, "chained")
        assert done.returncode == 1
        assert "previous hook ran" in done.stdout
        assert "RuntimeError: boom after step 3" in done.stderr
        (told,) = _finals(exporter)
        assert told is not None
        assert told.exception == "RuntimeError"


def test_a_close_in_finally_is_corrected_by_the_uncaught_exception() -> None:
    with LoopbackExporter() as exporter:
        done = _run(exporter, "finally")
        assert done.returncode == 1
        assert "RuntimeError: boom after step 3" in done.stderr
        # The close said finished; the exception reached the hook and said failed.
        first, corrected = _finals(exporter)
        assert first is None
        assert corrected is not None
        assert (corrected.exception, corrected.step, corrected.seen_by) == (
            "RuntimeError",
            3,
            "uncaught",
        )


def test_a_hook_that_calls_no_other_does_not_hide_the_failure() -> None:
    with LoopbackExporter() as exporter:
        done = _run(exporter, "hook_replaced")
        assert done.returncode == 1
        assert "a hook that calls no other" in done.stdout
        (told,) = _finals(exporter)
        assert told is not None
        assert (told.exception, told.message, told.seen_by) == (
            "KeyError",
            "'lost key'",
            "uncaught",
        )


def test_a_thread_that_closes_then_dies_ends_the_rank_failed() -> None:
    with LoopbackExporter() as exporter:
        done = _run(exporter, "thread_closes")
        assert done.returncode == 0  # the main thread ends normally
        assert "ValueError: bad batch" in done.stderr
        first, corrected = _finals(exporter)
        assert first is None
        assert corrected is not None
        assert (corrected.exception, corrected.seen_by) == ("ValueError", "thread")
