"""The web view and /docs in a real browser (Debian's headless chromium) against a live
exporter fed by real ranks: what the pages draw must be the API's data, the console must
stay clean, and no request may leave for another host."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest
from support import DEADLOCK_GUARD_S

from exporter.factory import body, steps
from exporter.web.browser import chromium, console_errors, foreign, requested_urls
from exporter.web.conftest import OVERFLOW_STEPS, RESTORE_AFTER, RUN, STEPS, LiveRun, get_json

pytestmark = pytest.mark.distributed

WAIT_S = DEADLOCK_GUARD_S


def _wait(driver: Any, script: str) -> Any:
    """Poll a JS expression until it is truthy; returns its value."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(
        lambda d: d.execute_script(f"return {script}")
    )


def _pixel_near(driver: Any, canvas: str, x: float, y: float, radius: int = 2) -> list[list[int]]:
    """RGB of the canvas pixels within ``radius`` of (x, y) in canvas pixels."""
    return driver.execute_script(
        """
        const [canvas, x, y, r] = arguments;
        const data = canvas.getContext('2d').getImageData(Math.round(x) - r, Math.round(y) - r,
                                                          2 * r + 1, 2 * r + 1).data;
        const out = [];
        for (let i = 0; i < data.length; i += 4) out.push([data[i], data[i + 1], data[i + 2]]);
        return out;
        """,
        driver.execute_script(f"return {canvas}"),
        x,
        y,
        radius,
    )


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def _close(pixel: list[int], color: tuple[int, int, int], tolerance: int = 40) -> bool:
    return all(abs(p - c) <= tolerance for p, c in zip(pixel, color, strict=True))


def _assert_clean(driver: Any, url: str) -> None:
    assert console_errors(driver) == []
    urls = requested_urls(driver)
    assert urls, "the performance log recorded no request"
    assert foreign(urls, url) == []


def test_runs_page_lists_the_run(live_run: LiveRun, tmp_path) -> None:
    health = get_json(f"{live_run.url}/api/v1/runs/{RUN}/health")
    with chromium(tmp_path) as driver:
        driver.get(live_run.url + "/")
        row = f"document.querySelector('#runs tr[data-run=\"{RUN}\"]')"
        _wait(driver, row)
        cells = driver.execute_script(
            f"return [...{row}.querySelectorAll('td')].map(td => td.textContent)"
        )
        assert cells[0] == RUN
        assert cells[1] == health["status"] == "critical"
        assert cells[2] == "2/2 up (world 2)"
        assert cells[4] == str(STEPS)
        assert cells[6] == str(len(OVERFLOW_STEPS))
        # Local: both ranks saw every overflow; origin: rank 1 alone produced them.
        assert cells[7] == f"{2 * len(OVERFLOW_STEPS)} / {len(OVERFLOW_STEPS)}"
        assert set(cells[8].split()) >= {"scale_desync", "inf_hotspot"}
        link = driver.execute_script(f"return {row}.querySelector('a').href")
        assert link == f"{live_run.url}/run?id={RUN}"
        _assert_clean(driver, live_run.url)


def test_run_page_draws_the_apis_data(live_run: LiveRun, tmp_path) -> None:
    health = get_json(f"{live_run.url}/api/v1/runs/{RUN}/health")
    series = get_json(f"{live_run.url}/api/v1/runs/{RUN}/series")
    truth = live_run.truth
    # The API holds what the ranks recorded, and the ranks split after the stale restore.
    assert series["steps"] == list(range(1, STEPS + 1))
    assert series["scale"] == [[scale for _, scale, _ in rank] for rank in truth]
    split = [s for (s, a, _), (_, b, _) in zip(*truth, strict=True) if a != b]
    assert split == list(range(RESTORE_AFTER + 1, STEPS + 1))

    with chromium(tmp_path) as driver:
        driver.get(f"{live_run.url}/run?id={RUN}")
        _wait(driver, "window.ampscopeRun.series && window.ampscopeRun.scalePlot")
        _wait(driver, "document.querySelectorAll('#verdicts li').length > 0")

        # Verdicts: every rule with the API's status and summary.
        shown = driver.execute_script(
            "return [...document.querySelectorAll('#verdicts li')].map(li => "
            "[li.dataset.rule, li.dataset.status, li.querySelector('.summary').textContent])"
        )
        assert shown == [[v["rule"], v["status"], v["summary"]] for v in health["verdicts"]]
        assert {"scale_desync": "critical", "inf_hotspot": "warning"}.items() <= {
            rule: status for rule, status, _ in shown
        }.items()
        assert driver.find_element("id", "run-status").text.lower() == "critical"

        # Scale lines: each rank's colour is drawn at (step, scale) of its own history. Before
        # the split rank 1 is drawn over rank 0; after it both lines show.
        plot = "window.ampscopeRun.scalePlot"
        assert driver.execute_script(f"return {plot}.data") == [
            series["steps"],
            *series["scale"],
        ]
        canvas = f"{plot}.ctx.canvas"
        for rank, history in enumerate(truth):
            color = _rgb(driver.execute_script(f"return window.ampscopeRun.rankColor({rank})"))
            for step, scale, _ in history:
                if rank == 0 and step not in split:
                    continue
                x, y = driver.execute_script(
                    f"return [{plot}.valToPos(arguments[0], 'x', true), "
                    f"{plot}.valToPos(arguments[1], 'y', true)]",
                    step,
                    scale,
                )
                pixels = _pixel_near(driver, canvas, x, y)
                assert any(_close(p, color) for p in pixels), (rank, step, scale, pixels)

        # Skips: one bar per overflow step, as high as the ranks that skipped (both).
        skipped = driver.execute_script("return window.ampscopeRun.skipsPlot.data[1]")
        assert skipped == [2 if s in OVERFLOW_STEPS else None for s in range(1, STEPS + 1)]

        # Found-inf heatmaps: a lit cell exactly where the ranks saw inf/NaN.
        lit = {"origin": (211, 47, 47), "local": (245, 124, 0)}
        for kind, expected in (
            ("origin", {(1, "cpu"): set(OVERFLOW_STEPS)}),
            ("local", {(0, "cpu"): set(OVERFLOW_STEPS), (1, "cpu"): set(OVERFLOW_STEPS)}),
        ):
            heatmap = f"window.ampscopeRun.heatmaps.{kind}"
            rows = driver.execute_script(
                f"return {heatmap}.rows.map(r => [r.rank, r.device, r.steps])"
            )
            drawn = {(rank, device): set(steps) for rank, device, steps in rows}
            # Rank 0 has an origin row only if it reports its (zero) origin count.
            assert {k: v for k, v in drawn.items() if v} == expected, kind
            for index, (rank, device, _) in enumerate(rows):
                for step in range(1, STEPS + 1):
                    x, y = driver.execute_script(
                        f"const c = {heatmap}.cellCenter(arguments[0], arguments[1]);"
                        "return [c.x, c.y];",
                        index,
                        step,
                    )
                    (pixel,) = _pixel_near(driver, f"{heatmap}.canvas", x, y, radius=0)
                    want = step in expected.get((rank, device), set())
                    assert _close(pixel, lit[kind], 10) == want, (kind, rank, step, pixel)

        # Hovering a lit cell names its rank, device and step.
        from selenium.webdriver.common.action_chains import ActionChains

        canvas_el = driver.find_element("id", "origin-heatmap")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas_el)
        row = driver.execute_script(
            "return window.ampscopeRun.heatmaps.origin.rows.findIndex(r => r.rank === 1)"
        )
        step = OVERFLOW_STEPS[0]
        x, y, width, height = driver.execute_script(
            "const c = window.ampscopeRun.heatmaps.origin.cellCenter(arguments[0], arguments[1]);"
            "const box = arguments[2].getBoundingClientRect();"
            "return [c.x, c.y, box.width, box.height];",
            row,
            step,
            canvas_el,
        )
        offset = (round(x - width / 2), round(y - height / 2))  # from the element's centre
        ActionChains(driver).move_to_element_with_offset(canvas_el, *offset).perform()
        tooltip = _wait(driver, "document.getElementById('tooltip').textContent")
        assert tooltip == f"rank 1 cpu, step {step}: inf/NaN (origin)"

        # Ranks table: the API's states and steps.
        ranks = get_json(f"{live_run.url}/api/v1/runs/{RUN}/ranks")
        table = driver.execute_script(
            "return [...document.querySelectorAll('#ranks tbody tr')].map(tr => "
            "[...tr.querySelectorAll('td')].map(td => td.textContent))"
        )
        for row, view in zip(table, ranks, strict=True):
            state = view.get("state") or ("up" if view["up"] else "stale")
            assert row[:4] == [str(view["rank"]), view["node"], state, str(view["step"])]
        _assert_clean(driver, live_run.url)


def _whole_ticks(driver: Any, url: str, run: str, count: int) -> dict[str, list[float]]:
    """The ticks of the axes that count whole things (both charts' steps, the skipped
    chart's ranks) once ``run``'s page showed ``count`` steps (uPlot keeps an axis' ticks in
    ``_splits``; the vendored uPlot is pinned)."""
    driver.get(f"{url}/run?id={run}")
    shown = "window.ampscopeRun && window.ampscopeRun.series"
    _wait(driver, f"{shown} && {shown}.steps.length == {count}")
    axes = {"scale steps": "scalePlot.axes[0]", "skipped steps": "skipsPlot.axes[0]"}
    axes["skipped ranks"] = "skipsPlot.axes[1]"
    ticks = {name: f"window.ampscopeRun.{axis}._splits" for name, axis in axes.items()}
    _wait(driver, " && ".join(ticks.values()))
    return {name: driver.execute_script(f"return {js}") for name, js in ticks.items()}


@pytest.mark.parametrize("count", [1, 2, 7, STEPS])
def test_steps_and_rank_counts_tick_whole_numbers_only(
    live_run: LiveRun, tmp_path, count: int
) -> None:
    run = RUN
    if count != STEPS:  # a short run of its own, posted as a reporter would
        run = f"ticks-{count}"
        request = urllib.request.Request(
            f"{live_run.url}/api/v1/ingest", data=body(*steps(1, count, run=run)), method="POST"
        )
        with urllib.request.urlopen(request, timeout=DEADLOCK_GUARD_S) as answer:
            assert answer.status == 200
    with chromium(tmp_path) as driver:
        for plot, ticks in _whole_ticks(driver, live_run.url, run, count).items():
            assert ticks, plot
            assert all(tick == int(tick) for tick in ticks), (plot, ticks)


def test_docs_render_offline(live_run: LiveRun, tmp_path) -> None:
    with chromium(tmp_path) as driver:
        driver.get(live_run.url + "/docs")
        paths = _wait(
            driver,
            "document.querySelectorAll('.opblock-summary-path').length > 0 && "
            "[...document.querySelectorAll('.opblock-summary-path')].map(e => e.textContent)",
        )
        assert "/api/v1/runs/{run}/series" in [p.replace("\u200b", "") for p in paths]
        assert "/api/v1/ingest" in [p.replace("\u200b", "") for p in paths]
        _assert_clean(driver, live_run.url)
