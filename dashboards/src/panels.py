"""The shapes the ampscope dashboard's panels take, as grafana-foundation-sdk builders.

Each function returns one panel of a recurring shape with the house settings filled in (the
``$datasource`` variable, Prometheus targets in code mode, one legend and tooltip style), so
a panel in ``ampscope_dashboard.py`` names only what is its own: id, title, description,
queries and, where it differs, unit, size, axis and threshold.

The SDK's dashboard builder places the panels: a row starts a new line, and panels fill it
left to right (24 columns wide) in the order they are added. Panel ids are given explicitly
and never reused, so a link to one panel (``viewPanel=ID``) keeps opening the same panel.
"""

from __future__ import annotations

from dataclasses import dataclass
from string import ascii_uppercase
from typing import Protocol, Self, TypeVar

from grafana_foundation_sdk.builders import (
    bargauge,
    heatmap,
    prometheus,
    stat,
    statetimeline,
    table,
    timeseries,
)
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.cog import builder as cog_builder
from grafana_foundation_sdk.cog import variants as cog_variants
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import heatmap as heatmap_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

# Every panel and query reads the data source the $datasource variable picks.
DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
# The variables' selection, for the families that carry a rank's labels.
RANK_SELECTOR = 'run=~"$run", node=~"$node", rank=~"$rank"'
RANK_LEGEND = "{{run}} rank {{rank}}"

# Values that hold until the next sample (counters, states, a scale) step; measurements
# taken at each iteration (loss, norms) are drawn as lines between samples.
STEP = common.LineInterpolation.STEP_AFTER
LINEAR = common.LineInterpolation.LINEAR


def per_rank(family: str, *matchers: str) -> str:
    """``family`` narrowed to the selected runs, nodes and ranks, plus ``matchers``.

    Args:
        family: A metric family (or recording rule) with the rank labels.
        matchers: More label matchers, e.g. ``'kind="loss"'``.

    Returns:
        The PromQL selector, e.g. ``ampscope_loss{run=~"$run", node=~"$node", rank=~"$rank"}``.
    """
    return f"{family}{{{', '.join((RANK_SELECTOR, *matchers))}}}"


@dataclass(frozen=True)
class Query:
    """One Prometheus query of a panel.

    Attributes:
        expr: The PromQL expression.
        legend: The legend format, e.g. ``{{run}} rank {{rank}}``.
        instant: Query the newest value only (stat, table and bar gauge panels), not a range.
        table: Return the labels as table columns (Prometheus' ``table`` format).
    """

    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False

    def target(self, ref_id: str) -> prometheus.Dataquery:
        """The SDK's Prometheus query for this one, under ``ref_id``."""
        target = (
            prometheus.Dataquery()
            .datasource(DATASOURCE)
            .expr(self.expr)
            .legend_format(self.legend)
            .ref_id(ref_id)
            .editor_mode(prometheus_models.QueryEditorMode.CODE)
        )
        target = target.instant() if self.instant else target.range()
        if self.table:
            target = target.format(prometheus_models.PromQueryFormat.TABLE)
        return target


class _PanelBuilder(Protocol):
    """What every panel builder of the SDK offers (each panel type has its own class)."""

    def id(self, id_val: int) -> Self: ...
    def title(self, title: str) -> Self: ...
    def description(self, description: str) -> Self: ...
    def datasource(self, datasource: dashboard_models.DataSourceRef) -> Self: ...
    def height(self, h: int) -> Self: ...
    def span(self, w: int) -> Self: ...
    def with_target(self, target: cog_builder.Builder[cog_variants.Dataquery]) -> Self: ...
    def thresholds(
        self, thresholds: cog_builder.Builder[dashboard_models.ThresholdsConfig]
    ) -> Self: ...


PanelT = TypeVar("PanelT", bound=_PanelBuilder)


def _panel(
    panel: PanelT,
    panel_id: int,
    title: str,
    description: str,
    queries: tuple[Query, ...],
    size: tuple[int, int],
    thresholds: dashboard_builders.ThresholdsConfig,
) -> PanelT:
    """``panel`` with what every panel has: identity, data source, size, queries A, B, …"""
    width, height = size
    panel = (
        panel.id(panel_id)
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(width)
        .height(height)
        .thresholds(thresholds)
    )
    for letter, query in zip(ascii_uppercase, queries, strict=False):
        panel = panel.with_target(query.target(letter))
    return panel


def _thresholds(base: str, red_at: float | None = None) -> dashboard_builders.ThresholdsConfig:
    """The base colour from minus infinity, red from ``red_at`` on (when given)."""
    steps = [dashboard_models.Threshold(value=None, color=base)]
    if red_at is not None:
        steps.append(dashboard_models.Threshold(value=red_at, color="red"))
    return (
        dashboard_builders.ThresholdsConfig()
        .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
        .steps(steps)
    )


def _colors(mode: dashboard_models.FieldColorModeId) -> dashboard_builders.FieldColor:
    return dashboard_builders.FieldColor().mode(mode)


def _newest_value() -> common_builders.ReduceDataOptions:
    """One number per series: its newest value that is not null."""
    return common_builders.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)


def _legend(*, show: bool = True) -> common_builders.VizLegendOptions:
    return (
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(show)
    )


def _tooltip(
    mode: common.TooltipDisplayMode, sort: common.SortOrder
) -> common_builders.VizTooltipOptions:
    return common_builders.VizTooltipOptions().mode(mode).sort(sort)


def row(panel_id: int, title: str) -> dashboard_builders.Row:
    """An expanded row: the panels added after it, up to the next row, sit under it."""
    return dashboard_builders.Row(title).id(panel_id).collapsed(False)


def _time_series(
    panel_id: int,
    title: str,
    description: str,
    queries: tuple[Query, ...],
    size: tuple[int, int],
    unit: str,
    red_at: float | None,
) -> timeseries.Panel:
    """A time series panel with the settings lines and bars share."""
    return (
        _panel(
            timeseries.Panel(),
            panel_id,
            title,
            description,
            queries,
            size,
            _thresholds("green", red_at),
        )
        .unit(unit)
        .line_width(1)
        .show_points(common.VisibilityMode.NEVER)
        .span_nulls(False)
        .axis_placement(common.AxisPlacement.AUTO)
        .color_scheme(_colors(dashboard_models.FieldColorModeId.PALETTE_CLASSIC))
        .legend(_legend())
        .tooltip(_tooltip(common.TooltipDisplayMode.MULTI, common.SortOrder.DESCENDING))
    )


def series(
    panel_id: int,
    title: str,
    description: str,
    *queries: Query,
    unit: str = "short",
    width: int = 12,
    height: int = 8,
    interpolation: common.LineInterpolation = STEP,
    log: int | None = None,
    min_value: float | None = None,
    max_value: float | None = None,
    red_at: float | None = None,
) -> timeseries.Panel:
    """A time series of lines, one per series, legend below, every series in the tooltip.

    Args:
        panel_id: The panel's id, unique in the dashboard.
        title: The panel title.
        description: What the panel shows and how to read it (the panel's info tooltip).
        queries: The panel's queries, lettered A, B, … in order.
        unit: Grafana's unit id for the y axis.
        width: Columns, of 24.
        height: Grid rows.
        interpolation: How a line goes from one sample to the next.
        log: The y axis' logarithm base; linear when None.
        min_value: The y axis' lower end; automatic when None.
        max_value: The y axis' upper end; automatic when None.
        red_at: A value from which on the series turn red, drawn as a threshold line.

    Returns:
        The panel builder.
    """
    panel = (
        _time_series(panel_id, title, description, queries, (width, height), unit, red_at)
        .draw_style(common.GraphDrawStyle.LINE)
        .fill_opacity(10)
        .line_interpolation(interpolation)
    )
    if log is not None:
        panel = panel.scale_distribution(
            common_builders.ScaleDistributionConfig().type(common.ScaleDistribution.LOG).log(log)
        )
    if red_at is not None:
        panel = panel.thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.LINE)
        )
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    return panel


def bars(
    panel_id: int,
    title: str,
    description: str,
    *queries: Query,
    unit: str = "short",
    width: int = 12,
    height: int = 8,
    colors: tuple[str, ...] = (),
) -> timeseries.Panel:
    """A time series of bars from 0: counts per interval, e.g. ``increase(...[$__rate_interval])``.

    Arguments as for :func:`series`, and:
        colors: One fixed colour per query, in order (Grafana's names: ``red``, ``orange``),
            for panels whose queries mean different things; without, the classic palette.
    """
    panel = (
        _time_series(panel_id, title, description, queries, (width, height), unit, None)
        .draw_style(common.GraphDrawStyle.BARS)
        .fill_opacity(80)
        .line_interpolation(STEP)
        .min(0)
    )
    for letter, color in zip(ascii_uppercase, colors, strict=False):
        fixed = dashboard_models.DynamicConfigValue(
            id_val="color", value={"mode": "fixed", "fixedColor": color}
        )
        panel = panel.override_by_query(letter, [fixed])
    return panel


def number(
    panel_id: int,
    title: str,
    description: str,
    query: Query,
    *,
    width: int,
    height: int,
    no_value: str,
    color: str = "green",
    red_at: float | None = None,
    background: bool = False,
    sparkline: bool = False,
) -> stat.Panel:
    """A stat panel: each series' newest value, with its name.

    Args:
        panel_id: The panel's id, unique in the dashboard.
        title: The panel title.
        description: What the panel shows and how to read it.
        query: The panel's one query.
        width: Columns, of 24.
        height: Grid rows.
        no_value: What the panel says when the query returns nothing.
        color: The value's colour below ``red_at``.
        red_at: A value from which on the number turns red.
        background: Colour the panel's background, not the number.
        sparkline: Draw the series' recent values behind the number.

    Returns:
        The panel builder.
    """
    return (
        _panel(
            stat.Panel(),
            panel_id,
            title,
            description,
            (query,),
            (width, height),
            _thresholds(color, red_at),
        )
        .unit("short")
        .no_value(no_value)
        .color_scheme(_colors(dashboard_models.FieldColorModeId.THRESHOLDS))
        .reduce_options(_newest_value())
        .orientation(common.VizOrientation.AUTO)
        .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
        .color_mode(
            common.BigValueColorMode.BACKGROUND if background else common.BigValueColorMode.VALUE
        )
        .graph_mode(common.BigValueGraphMode.AREA if sparkline else common.BigValueGraphMode.NONE)
        .justify_mode(common.BigValueJustifyMode.AUTO)
        .show_percent_change(False)
        .wide_layout(True)
    )


def label_table(
    panel_id: int,
    title: str,
    description: str,
    query: Query,
    *,
    columns: list[str],
    hidden: list[str],
    width: int,
    height: int,
    renamed: dict[str, str] | None = None,
) -> table.Panel:
    """A table of the label sets ``query`` returns, one row per series, sorted by ``columns[0]``.

    Args:
        panel_id: The panel's id, unique in the dashboard.
        title: The panel title.
        description: What the panel shows and how to read it.
        query: An instant query in table format.
        columns: The labels shown, in this order.
        hidden: The columns left out (the sample's time and value, Prometheus' own labels).
        width: Columns, of 24.
        height: Grid rows.
        renamed: Headers for columns shown under another name (the sample's ``Value``).

    Returns:
        The panel builder.
    """
    organize = dashboard_models.DataTransformerConfig(
        id_val="organize",
        options={
            "excludeByName": dict.fromkeys(hidden, True),
            "indexByName": {name: index for index, name in enumerate(columns)},
            "renameByName": renamed or {},
        },
    )
    return (
        _panel(
            table.Panel(),
            panel_id,
            title,
            description,
            (query,),
            (width, height),
            _thresholds("green"),
        )
        .align(common.FieldTextAlignment.AUTO)
        .cell_options(common.TableAutoCellOptions())
        .show_header(True)
        .cell_height(common.TableCellHeight.SM)
        .footer(common_builders.TableFooterOptions().show(False).reducer(["sum"]))
        .sort_by([common_builders.TableSortByFieldState().display_name(columns[0]).desc(False)])
        .with_transformation(organize)
    )


def top_bars(
    panel_id: int,
    title: str,
    description: str,
    *queries: Query,
    width: int = 12,
    height: int = 8,
) -> bargauge.Panel:
    """Horizontal bars of each series' newest value, yellow to red as it grows.

    Arguments as for :func:`series`; the queries are instant.
    """
    return (
        _panel(
            bargauge.Panel(),
            panel_id,
            title,
            description,
            queries,
            (width, height),
            _thresholds("green"),
        )
        .unit("short")
        .min(0)
        .color_scheme(_colors(dashboard_models.FieldColorModeId.CONTINUOUS_YL_RD))
        .orientation(common.VizOrientation.HORIZONTAL)
        .display_mode(common.BarGaugeDisplayMode.GRADIENT)
        .show_unfilled(True)
        .reduce_options(_newest_value())
        .value_mode(common.BarGaugeValueMode.COLOR)
        .name_placement(common.BarGaugeNamePlacement.AUTO)
        .sizing(common.BarGaugeSizing.AUTO)
    )


def states(
    panel_id: int,
    title: str,
    description: str,
    query: Query,
    *,
    names: list[tuple[str, str]],
    width: int = 24,
    height: int = 8,
) -> statetimeline.Panel:
    """A state timeline: one band per series, coloured by state over time.

    Args:
        panel_id: The panel's id, unique in the dashboard.
        title: The panel title.
        description: What the panel shows and how to read it.
        query: A query whose value is the state's number.
        names: (name, colour) of state 0, 1, … in order.
        width: Columns, of 24.
        height: Grid rows.

    Returns:
        The panel builder.
    """
    mapping = dashboard_models.ValueMap(
        options={
            str(value): dashboard_models.ValueMappingResult(text=name, color=color, index=value)
            for value, (name, color) in enumerate(names)
        }
    )
    return (
        _panel(
            statetimeline.Panel(),
            panel_id,
            title,
            description,
            (query,),
            (width, height),
            _thresholds("green"),
        )
        .color_scheme(_colors(dashboard_models.FieldColorModeId.THRESHOLDS))
        .mappings([mapping])
        .line_width(0)
        .fill_opacity(80)
        .show_value(common.VisibilityMode.AUTO)
        .merge_values(True)
        .row_height(0.9)
        .align_value(common.TimelineValueAlignment.LEFT)
        .legend(_legend(show=False))
        .tooltip(_tooltip(common.TooltipDisplayMode.SINGLE, common.SortOrder.NONE))
    )


def series_heatmap(
    panel_id: int,
    title: str,
    description: str,
    query: Query,
    *,
    unit: str,
    scheme: str,
    min_value: float | None = None,
    max_value: float | None = None,
    width: int = 12,
    height: int = 10,
) -> heatmap.Panel:
    """A heatmap of series by time: one row per series (named by the query's legend), each
    cell coloured by the series' value there. Grafana computes no buckets: the series are
    the rows, in the order of their names.

    Args:
        panel_id: The panel's id, unique in the dashboard.
        title: The panel title.
        description: What the panel shows and how to read it.
        query: A range query; its legend names each row.
        unit: Grafana's unit id for the values (the colour scale and the tooltip).
        scheme: Grafana's name of a sequential colour scheme, e.g. ``"Oranges"``.
        min_value: The colour scale's lower end; the data's least value when None.
        max_value: The colour scale's upper end; the data's greatest value when None.
        width: Columns, of 24.
        height: Grid rows.

    Returns:
        The panel builder.
    """
    color = (
        heatmap.HeatmapColorOptions()
        .mode(heatmap_models.HeatmapColorMode.SCHEME)
        .scheme(scheme)
        .fill("dark-orange")
        .scale(heatmap_models.HeatmapColorScale.LINEAR)
        .exponent(0.5)
        .steps(64)
        .reverse(False)
    )
    if min_value is not None:
        color = color.min(min_value)
    if max_value is not None:
        color = color.max(max_value)
    return (
        _panel(
            heatmap.Panel(),
            panel_id,
            title,
            description,
            (query,),
            (width, height),
            _thresholds("green"),
        )
        .calculate(False)
        # Every value is drawn: the SDK's default hides cells at or below 1e-9, which would
        # hide a zero underflow and every negative logarithm.
        .filter_values(heatmap.FilterValueRange())
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.UNKNOWN))
        .color(color)
        .cell_values(heatmap.CellValues().unit(unit))
        .y_axis(heatmap.YAxisConfig().axis_placement(common.AxisPlacement.LEFT).reverse(False))
        .cell_gap(1)
        .show_value(common.VisibilityMode.NEVER)
        .show_legend()
        .mode(common.TooltipDisplayMode.SINGLE)
        .show_color_scale(True)
    )
