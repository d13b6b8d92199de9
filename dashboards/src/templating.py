"""The dashboard's variables and annotations, and the two fields the SDK's types lack.

grafana-foundation-sdk models a dashboard variable without ``definition`` (the query as
Grafana's variable list shows it, which its own editor always writes) and an annotation
without the Prometheus annotation's fields (``step``, ``titleFormat``, ``textFormat``,
``tagKeys``, ``useValueForTime``). Both are added here as small subclasses of the SDK's
models and builders, so everything else stays the SDK's own.
"""

from __future__ import annotations

from typing import Self

from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.models import dashboard as dashboard_models
from panels import DATASOURCE

# A variable's "All": every value, matched by this regex rather than a list of them all.
ALL = dashboard_models.VariableOption(selected=True, text=["All"], value=["$__all"])
# Prometheus' variable editor: the query type "label values".
_LABEL_VALUES = 1


class _DefinedVariable(dashboard_models.VariableModel):
    """A variable that also writes ``definition``."""

    definition: str | None = None

    def to_json(self) -> dict[str, object]:
        payload = super().to_json()
        if self.definition is not None:
            payload["definition"] = self.definition
        return payload


class _QueryVariable(dashboard_builders.QueryVariable):
    """The SDK's query variable builder, plus ``definition``."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._defined = _DefinedVariable(name=name, type_val=dashboard_models.VariableType.QUERY)
        self._internal = self._defined

    def definition(self, definition: str) -> Self:
        """The query as Grafana's variable list shows it."""
        self._defined.definition = definition
        return self


def label_values(
    name: str, label: str, query: str, sort: dashboard_models.VariableSort
) -> dashboard_builders.QueryVariable:
    """A multi-value variable of a label's values, "All" by default.

    Args:
        name: The variable's name, used as ``$name`` in queries.
        label: What the dashboard shows beside it.
        query: ``label_values(selector, label)``.
        sort: The order of the values in its menu.

    Returns:
        The variable builder.
    """
    return (
        _QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(
            {
                "query": query,
                "refId": f"PrometheusVariableQueryEditor-{name}",
                "qryType": _LABEL_VALUES,
            }
        )
        .definition(query)
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .regex("")
        .sort(sort)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(ALL)
        .options([])
        .hide(dashboard_models.VariableHide.DONT_HIDE)
    )


def single_label_value(
    name: str, label: str, query: str, sort: dashboard_models.VariableSort
) -> dashboard_builders.QueryVariable:
    """A variable holding one of a label's values (no "All"), the first by default.

    Args:
        name: The variable's name, used as ``$name`` in queries.
        label: What the dashboard shows beside it.
        query: ``label_values(selector, label)``.
        sort: The order of the values in its menu.

    Returns:
        The variable builder.
    """
    return (
        label_values(name, label, query, sort)
        .multi(False)
        .include_all(False)
        .current(dashboard_models.VariableOption(selected=False, text="", value=""))
    )


def datasource_variable() -> dashboard_builders.DatasourceVariable:
    """``$datasource``: which Prometheus the dashboard reads."""
    return (
        dashboard_builders.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .hide(dashboard_models.VariableHide.DONT_HIDE)
        .include_all(False)
        .multi(False)
        .regex("")
    )


def grafana_annotations() -> dashboard_builders.AnnotationQuery:
    """Grafana's built-in annotations and alerts, hidden from the dashboard's toggles."""
    return (
        dashboard_builders.AnnotationQuery()
        .built_in(1)
        .datasource(dashboard_models.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
        .enable(True)
        .hide(True)
        .icon_color("rgba(0, 211, 255, 1)")
        .name("Annotations & Alerts")
        .type("dashboard")
    )


class _PrometheusAnnotationModel(dashboard_models.AnnotationQuery):
    """An annotation that also writes the Prometheus annotation's fields."""

    step: str | None = None
    title_format: str | None = None
    text_format: str | None = None
    tag_keys: str | None = None
    use_value_for_time: bool | None = None

    def to_json(self) -> dict[str, object]:
        payload = super().to_json()
        extra = {
            "step": self.step,
            "titleFormat": self.title_format,
            "textFormat": self.text_format,
            "tagKeys": self.tag_keys,
            "useValueForTime": self.use_value_for_time,
        }
        payload.update({key: value for key, value in extra.items() if value is not None})
        return payload


class _PrometheusAnnotation(dashboard_builders.AnnotationQuery):
    """The SDK's annotation builder, plus the Prometheus annotation's fields."""

    def __init__(self) -> None:
        super().__init__()
        self._prometheus = _PrometheusAnnotationModel()
        self._internal = self._prometheus

    def step(self, step: str) -> Self:
        """The query's resolution."""
        self._prometheus.step = step
        return self

    def title_format(self, title_format: str) -> Self:
        """The mark's title, with ``{{label}}`` templates."""
        self._prometheus.title_format = title_format
        return self

    def text_format(self, text_format: str) -> Self:
        """The mark's text, with ``{{label}}`` templates."""
        self._prometheus.text_format = text_format
        return self

    def tag_keys(self, tag_keys: list[str]) -> Self:
        """Labels shown as the mark's tags."""
        self._prometheus.tag_keys = ",".join(tag_keys)
        return self

    def use_value_for_time(self, use_value_for_time: bool) -> Self:
        """Take the mark's time from the sample's value instead of its timestamp."""
        self._prometheus.use_value_for_time = use_value_for_time
        return self


def prometheus_annotation(
    name: str, expr: str, *, color: str, title: str, text: str, tags: list[str]
) -> dashboard_builders.AnnotationQuery:
    """Marks on every time series panel at each sample ``expr`` returns (a 30 s step).

    Args:
        name: The annotation's toggle on the dashboard.
        expr: PromQL; every sample it returns is one mark.
        color: The marks' colour.
        title: The mark's title, with ``{{label}}`` templates.
        text: The mark's text, with ``{{label}}`` templates.
        tags: Labels shown as the mark's tags.

    Returns:
        The annotation builder.
    """
    return (
        _PrometheusAnnotation()
        .name(name)
        .datasource(DATASOURCE)
        .enable(True)
        .hide(False)
        .icon_color(color)
        .expr(expr)
        .step("30s")
        .title_format(title)
        .text_format(text)
        .tag_keys(tags)
        .use_value_for_time(False)
    )
