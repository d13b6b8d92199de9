"""``ampscope status`` told something of the wrong shape: one line naming the target and the
fault, exit status 7, and in a fan-out the other targets still answer.

The wrong answers are a real exporter's answers (a real scaler reported to it) with one fault
each, served by a loopback server (``fake_api``); ``ampscope status`` runs as a user runs it.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_api import Reply, serving
from status_cli import run_status, train_scaler
from support import DEADLOCK_GUARD_S, free_port

from ampscope.demo.exporter import ExporterProcess
from ampscope.status import main as status_main
from ampscope.status import shapes

RUN = "stormy"
"""4 of its 12 steps overflowed: a skip storm, a warning (exit status 1)."""
RUNS = "/api/v1/runs"
RANKS = f"/api/v1/runs/{RUN}/ranks"
HEALTH = f"/api/v1/runs/{RUN}/health"


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[str, dict[str, Any]]]:
    """A live exporter's URL and its answers (path -> JSON) once its run is whole."""
    process = ExporterProcess(free_port())
    process.start()
    try:
        train_scaler(process.url, RUN, 12, {3, 6, 9, 12})
        deadline = time.monotonic() + DEADLOCK_GUARD_S
        while True:
            answers = {path: _get(process.url + path) for path in (RUNS, RANKS, HEALTH)}
            if [r["state"] for r in answers[RANKS]] == ["finished"]:
                break
            assert time.monotonic() < deadline, answers
            time.sleep(0.1)
        yield process.url, answers
    finally:
        process.stop()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=DEADLOCK_GUARD_S) as response:
        return json.load(response)


def _routes(answers: dict[str, Any], path: str, fault: Callable[[Any], Any]) -> dict[str, Reply]:
    """The real answers, the one at ``path`` changed by ``fault``."""
    routes = {p: Reply(copy.deepcopy(body)) for p, body in answers.items()}
    changed = fault(copy.deepcopy(answers[path]))
    routes[path] = changed if isinstance(changed, Reply) else Reply(changed)
    return routes


def _set(value: Any, *keys: Any) -> Callable[[Any], Any]:
    def fault(document: Any) -> Any:
        inner = document
        for key in keys[:-1]:
            inner = inner[key]
        inner[keys[-1]] = value
        return document

    return fault


def _drop(*keys: Any) -> Callable[[Any], Any]:
    def fault(document: Any) -> Any:
        inner = document
        for key in keys[:-1]:
            inner = inner[key]
        del inner[keys[-1]]
        return document

    return fault


def test_a_real_exporters_answers_have_the_shapes(real: tuple[str, dict[str, Any]]) -> None:
    _, answers = real
    for path, shape in ((RUNS, shapes.RUNS), (RANKS, shapes.RANKS), (HEALTH, shapes.HEALTH)):
        assert shapes.check(answers[path], shape, path) == answers[path]
    result = run_status(RUN, "--url", real[0])
    assert result.returncode == 1, result.stderr  # the shapes let the real run through


def test_a_failed_rank_and_a_failed_run_have_the_shapes(
    real: tuple[str, dict[str, Any]],
) -> None:
    # The real answers, as an exporter gives a rank that ended on an exception.
    ranks = copy.deepcopy(real[1][RANKS])
    ranks[0]["state"] = "failed"
    ranks[0]["failure"] = {
        "kind": "nonfinite_gradients",
        "exception": "NonFiniteGradientsError",
        "message": "ampscope: non-finite gradients at step 5",
        "step": 5,
        "origin_ranks": [0],
        "seen_by": "uncaught",
    }
    assert shapes.check(ranks, shapes.RANKS, RANKS) == ranks
    health = copy.deepcopy(real[1][HEALTH])
    health["state"] = "failed"
    health["states"] = {**health["states"], "finished": 0, "failed": 1}
    health["verdicts"].append(
        {"rule": "rank_failed", "status": "critical", "summary": "1 of 1 rank(s) failed",
         "evidence": {"failed": 1}, "thresholds": {}}
    )  # fmt: skip
    assert shapes.check(health, shapes.HEALTH, HEALTH) == health
    ranks[0]["failure"]["origin_ranks"] = ["0"]
    with pytest.raises(shapes.Malformed, match=r"\[0\]\.failure\.origin_ranks\[0\]: expected an"):
        shapes.check(ranks, shapes.RANKS, RANKS)


FAULTS = [
    (RUNS, lambda _: {}, "the answer: expected a list of runs, got an object ({})"),
    (RUNS, _set("12", 0, "newest_step"),
     '[0].newest_step: expected an integer, got a string ("12")'),
    (RUNS, _drop(0, "run"), "[0]: the key 'run' is missing"),
    (RUNS, lambda _: Reply(raw=b"<html>gateway</html>"),
     "not JSON (it begins '<html>gateway</html>')"),
    (RANKS, _set(["cpu"], 0, "totals", "found_inf_local"),
     '[0].totals.found_inf_local: expected an object, got an array (["cpu"])'),
    (RANKS, _set(True, 0, "step"), "[0].step: expected an integer, got a boolean (true)"),
    (RANKS, lambda ranks: ranks[0], "the answer: expected a list of ranks, got an object"),
    (RANKS, _set({"exception": "RuntimeError", "step": "7"}, 0, "failure"),
     '[0].failure.step: expected an integer, got a string ("7")'),
    (HEALTH, _set("fine", "status"), 'status: expected "ok" or "warning" or "critical", got a '
     'string ("fine")'),
    (HEALTH, _drop("verdicts", 0, "summary"), "verdicts[0]: the key 'summary' is missing"),
    (HEALTH, _set(None, "verdicts"), "verdicts: expected a list of verdicts, got null"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "fault", "what", "one_run"),
    # Asked for one run, status reads that run's ranks and health only, never the list.
    [
        (*fault, one_run)
        for fault in FAULTS
        for one_run in (False, True)
        if fault[0] != RUNS or not one_run
    ],
)
def test_a_wrong_shape_is_one_line_and_exit_status_7(
    real: tuple[str, dict[str, Any]],
    path: str,
    fault: Callable[[Any], Any],
    what: str,
    one_run: bool,
) -> None:
    with serving(_routes(real[1], path, fault)) as api:
        result = run_status(*([RUN] if one_run else []), "--url", api.url)
    assert result.returncode == 7, result.stdout + result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"ampscope status: {api.url}{path} answered JSON of the wrong shape: ")
    assert what in line
    assert line.endswith(".")


def test_a_malformed_target_is_named_and_the_others_answer(
    real: tuple[str, dict[str, Any]],
) -> None:
    exporter, answers = real
    with serving(_routes(answers, RUNS, lambda _: {})) as bad:
        result = run_status("--url", exporter, "--url", bad.url)
        assert result.returncode == 1, result.stderr  # the real run's skip storm
        lines = result.stdout.splitlines()
        assert lines[1].split()[:2] == [RUN, "WARNING"]
        failed = lines[lines.index("exporters without a usable answer:") + 1]
        assert failed.split()[:2] == ["malformed", f"{bad.url}:"]
        assert "expected a list of runs, got an object ({})" in failed

        listing = json.loads(run_status("--json", "--url", exporter, "--url", bad.url).stdout)
        assert [(t["url"], t["status"]) for t in listing["targets"]] == [
            (exporter, "ok"),
            (bad.url, "malformed"),
        ]
        assert listing["targets"][1]["error"].startswith(f"{bad.url}{RUNS} answered JSON")

    with serving(_routes(answers, HEALTH, _set("fine", "status"))) as bad:
        result = run_status(RUN, "--url", exporter, "--url", bad.url)
        assert result.returncode == 1, result.stderr
        assert "1/2 exporter(s) answered" in result.stdout.splitlines()[0]
        assert result.stdout.splitlines()[-1].split()[:2] == ["malformed", f"{bad.url}:"]


def test_a_listed_run_without_ranks_is_shown_not_a_crash(
    real: tuple[str, dict[str, Any]],
) -> None:
    # The right shape, told inconsistently: the list names a run whose ranks are none.
    with serving(_routes(real[1], RANKS, lambda _: [])) as api:
        result = run_status("--url", api.url)
    assert result.returncode == 1, result.stderr  # the run's health, as the exporter said
    assert result.stdout.splitlines()[1].split()[:3] == [RUN, "WARNING", "1/1"]


def test_no_usable_answer_is_3_or_above(real: tuple[str, dict[str, Any]]) -> None:
    _, answers = real
    with (
        serving(_routes(answers, RUNS, lambda _: {})) as one,
        serving(_routes(answers, RANKS, lambda ranks: ranks[0])) as two,
    ):
        result = run_status("--url", one.url, "--url", two.url)
        assert result.returncode == 7, result.stderr  # every target malformed: 7
        assert result.stdout == ""
        assert result.stderr.splitlines()[0] == "ampscope status: no exporter answered usably:"
        assert [line.split()[:2] for line in result.stderr.splitlines()[1:]] == [
            ["malformed", f"{one.url}:"],
            ["malformed", f"{two.url}:"],
        ]

        dead = f"http://127.0.0.1:{free_port()}"
        result = run_status("--url", one.url, "--url", dead)
        assert result.returncode == 3, result.stderr  # mixed failures: unreachable's 3
        assert result.stderr.splitlines()[0] == "ampscope status: no exporter answered usably:"
        assert [line.split()[:2] for line in result.stderr.splitlines()[1:]] == [
            ["malformed", f"{one.url}:"],
            ["unreachable", f"{dead}:"],
        ]


def _vector(*samples: dict[str, Any]) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "vector", "result": list(samples)}}


def _sample(value: str = "3", **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [1_700_000_000.0, value]}


RANK = {"run": RUN, "rank": "0", "node": "n0"}

PROMETHEUS_FAULTS = [
    ({}, "the answer: the key 'status' is missing"),
    ([], "the answer: expected an object, got an array ([])"),
    ({"status": "success", "data": {"resultType": "matrix", "result": []}},
     'data.resultType: expected "vector", got a string ("matrix")'),
    ({"status": "success"}, "data: expected a query's data (an object), got null"),
    (_vector(_sample(__name__="ampscope_last_step", run=RUN, rank="0")),
     "data.result[0].metric: ampscope_last_step has no 'node' label"),
    (_vector(_sample(__name__="ampscope_last_step", **{**RANK, "rank": "zero"})),
     'data.result[0].metric.rank: expected an integer, got a string ("zero")'),
    (_vector(_sample("lots", __name__="ampscope_last_step", **RANK)),
     'data.result[0].value[1]: expected a number as a string, got a string ("lots")'),
    (_vector({"metric": RANK, "value": 3}),
     "data.result[0].value: expected [time, value], got a number (3)"),
    (_vector(_sample(__name__="ampscope_rank_state", **RANK)),
     "data.result[0].metric: ampscope_rank_state has no 'state' label"),
]  # fmt: skip


@pytest.mark.parametrize(("answer", "what"), PROMETHEUS_FAULTS)
def test_a_wrong_shape_from_prometheus_is_one_line_and_exit_status_7(
    answer: Any, what: str
) -> None:
    with serving({"/api/v1/query": Reply(answer)}) as prometheus:
        result = run_status(RUN, "--prometheus", prometheus.url)
    assert result.returncode == 7, result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"ampscope status: {prometheus.url}/api/v1/query")
    assert line.endswith(f" answered JSON of the wrong shape: {what}."), line


def test_an_error_answer_from_prometheus_stays_exit_status_3() -> None:
    error = {"status": "error", "errorType": "bad_data", "error": "parse error at char 3"}
    with serving({"/api/v1/query": Reply(error)}) as prometheus:
        result = run_status("--prometheus", prometheus.url)
    assert result.returncode == 3
    assert result.stderr == (
        f"ampscope status: {prometheus.url} answered an error: parse error at char 3.\n"
    )


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    status_main.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_an_unexpected_error_is_one_line_and_exit_status_70(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fault inside ampscope itself (here: the table code raising) must not read as a
    verdict (0, 1, 2) nor as a traceback; --debug shows the traceback."""

    def broken(*_: Any) -> tuple[str, int]:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(status_main, "_frame", broken)
    assert status_main.run(_args("--url", "http://127.0.0.1:9")) == 70
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "ampscope status: internal error, please report it: ZeroDivisionError: division by "
        "zero; --debug prints the traceback"
    ]
    assert status_main.run(_args("--debug", "--url", "http://127.0.0.1:9")) == 70
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "in broken" in err
    assert err.splitlines()[-1].endswith("ZeroDivisionError: division by zero")
