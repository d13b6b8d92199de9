"""``ampscope status``'s lines for the FP8 verdicts, from one exporter's real answers."""

from __future__ import annotations

from exporter.factory import FakeClock, body, totals, watch
from fastapi.testclient import TestClient

from ampscope.exporter.app import create_app
from ampscope.exporter.settings import Settings
from ampscope.reporter.schema import Fp8Tensor
from ampscope.status import render
from ampscope.status.main import exit_status


def _tensor(layer: str, tensor: str, amax: float | None, underflow: float) -> Fp8Tensor:
    return Fp8Tensor(
        layer=layer,
        tensor=tensor,  # type: ignore[arg-type]
        cast="grad_input_gemm" if tensor == "grad_output" else "output_gemm",
        dtype="float8_e5m2" if tensor == "grad_output" else "float8_e4m3fn",
        rowwise=False,
        amax=amax,
        underflow_ratio=underflow,
        scale=448.0,
        scale_min=448.0,
    )


def _step(step: int, rank: int) -> object:
    """Rank 0's layers.1 input spikes at step 30; rank 1's layers.0 grad_output underflows
    30 % throughout, and its layers.1 weight turns inf at step 30."""
    entries = []
    for layer in ("layers.0", "layers.1"):
        for tensor in ("input", "weight", "grad_output"):
            amax: float | None = 2.0
            underflow = 0.01
            if rank == 0 and step == 30 and (layer, tensor) == ("layers.1", "input"):
                amax = 64.0
            if rank == 1 and (layer, tensor) == ("layers.0", "grad_output"):
                underflow = 0.3
            if rank == 1 and step == 30 and (layer, tensor) == ("layers.1", "weight"):
                amax = None
            entries.append(_tensor(layer, tensor, amax, underflow))
    return watch(step, run="fp8", rank=rank, total=totals(step), fp8=entries)


def _answers() -> tuple[list, dict, dict]:
    with TestClient(create_app(Settings(), clock=FakeClock())) as client:
        for rank in (0, 1):
            batch = body(*[_step(s, rank) for s in range(1, 31)])
            assert client.post("/api/v1/ingest", content=batch).status_code == 200
        runs = client.get("/api/v1/runs").json()
        ranks = {"fp8": client.get("/api/v1/runs/fp8/ranks").json()}
        health = {"fp8": client.get("/api/v1/runs/fp8/health").json()}
    return runs, ranks, health


def test_one_run_lists_each_flagged_fp8_series_critical_first() -> None:
    runs, ranks, health = _answers()
    lines = render.run_table("fp8", ranks["fp8"], health["fp8"])
    start = lines.index("FP8 series flagged:")
    header, *rows = lines[start + 1 : lines.index("health:") - 1]
    assert header.split() == ["RULE", "RANK", "NODE", "LAYER", "TENSOR", "STEP", "WHAT"]
    cells = [row.split(None, 7) for row in rows]
    assert [c[:7] for c in cells] == [
        ["CRIT", "fp8_nonfinite_amax", "1", "node0", "layers.1", "weight", "30"],
        ["WARN", "fp8_amax_spike", "0", "node0", "layers.1", "input", "30"],
        ["WARN", "fp8_underflow", "1", "node0", "layers.0", "grad_output", "30"],
    ]
    assert [c[7] for c in cells] == [
        "amax inf or NaN",
        "amax 64, 32x its median 2",
        "30% of non-zero values underflow",
    ]
    # Each FP8 verdict has its line under health:, marked by its status.
    verdicts = {line.split()[1]: line.split()[0] for line in lines[lines.index("health:") + 1 :]}
    assert (verdicts["fp8_nonfinite_amax"], verdicts["fp8_amax_spike"]) == ("CRIT", "WARN")
    assert verdicts["fp8_underflow"] == "WARN"
    assert exit_status({"runs": runs, "ranks": ranks, "health": health}) == 2
    # The runs table names the flagged FP8 rules of the run.
    overview = render.runs_table(runs, ranks, health)
    assert "fp8_amax_spike,fp8_underflow,fp8_nonfinite_amax" in overview[1]


def test_the_job_table_names_the_fp8_ranks_as_outliers() -> None:
    _, ranks, health = _answers()
    lines = render.job_table("fp8", ranks["fp8"], health["fp8"], [], [])
    outliers = lines[lines.index("outlier ranks:") + 2 : lines.index("outlier ranks:") + 4]
    assert [row.split()[0] for row in outliers] == ["0", "1"]
    assert outliers[1].split()[-1] == "fp8_underflow,fp8_nonfinite_amax"
    assert "FP8 series flagged:" in lines


def test_no_fp8_lines_for_a_calm_run_or_one_without_fp8_layers() -> None:
    with TestClient(create_app(Settings(), clock=FakeClock())) as client:
        calm = [watch(s, run="calm", fp8=[_tensor("layers.0", "input", 2.0, 0.0)]) for s in (1, 2)]
        assert client.post("/api/v1/ingest", content=body(*calm)).status_code == 200
        health = client.get("/api/v1/runs/calm/health").json()
    assert render.fp8_lines(health) == []
    rules = [v["rule"] for v in health["verdicts"]]
    assert {"fp8_amax_spike", "fp8_underflow", "fp8_nonfinite_amax"} <= set(rules)


def test_series_beyond_the_evidence_are_counted_in_a_line() -> None:
    entry = {"rank": 0, "node": "n0", "layer": "l", "tensor": "input", "step": 3, "ratio": 0.5}
    verdict = {
        "rule": "fp8_underflow",
        "status": "warning",
        "summary": "FP8 casts underflow in 20 series",
        "evidence": {"series_affected": 20, "series": [entry] * 16},
        "thresholds": {},
    }
    lines = render.fp8_lines({"verdicts": [verdict]})
    assert len(lines) == 2 + 1 + 16 + 1
    assert lines[-1] == "  … and 4 more series (a verdict lists at most 16 per exporter)"
