"""``ampscope status RUN --suspect-batches`` across exporters: the lines add up, sorted, and
an answer of the wrong shape names its exporter without hiding the others."""

from __future__ import annotations

import json

from fake_api import Reply, serving
from status_cli import run_status

PATH = "/api/v1/runs/job/suspect-batches"


def _row(step: int, rank: int, ids: list[int | str]) -> dict[str, object]:
    return {
        "step": step,
        "rank": rank,
        "reasons": ["loss_spike"],
        "batch_ids": ids,
        "batch_ids_left_out": 0,
    }


def test_two_nodes_lines_are_merged_in_step_order() -> None:
    node0 = [_row(5, 0, [1, 2]), _row(9, 1, ["a"])]
    node1 = [_row(7, 2, [3])]
    with serving({PATH: Reply(node0)}) as a, serving({PATH: Reply(node1)}) as b:
        result = run_status("job", "--suspect-batches", "--url", a.url, "--url", b.url)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line) for line in result.stdout.splitlines()] == [
        node0[0],
        node1[0],
        node0[1],
    ]


def test_a_wrong_shape_is_named_and_the_others_print() -> None:
    good = [_row(5, 0, [1])]
    bad_rows = [{**_row(6, 1, [1]), "batch_ids": [1.5]}]
    with serving({PATH: Reply(good)}) as a, serving({PATH: Reply(bad_rows)}) as b:
        result = run_status("job", "--suspect-batches", "--url", a.url, "--url", b.url)
        alone = run_status("job", "--suspect-batches", "--url", b.url)
    assert result.returncode == 0
    assert [json.loads(line) for line in result.stdout.splitlines()] == good
    assert f"{b.url}{PATH} answered JSON of the wrong shape" in result.stderr
    assert "[0].batch_ids[0]: expected an integer or a string, got a number (1.5)" in result.stderr
    assert alone.returncode == 7
    assert alone.stdout == ""


def test_without_a_run_it_says_so() -> None:
    result = run_status("--suspect-batches", url="http://127.0.0.1:1")
    assert result.returncode == 4
    assert "--suspect-batches needs a RUN" in result.stderr
