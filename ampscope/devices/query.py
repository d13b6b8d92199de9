"""The PromQL of ``ampscope devices`` and the checks of its answers (the client is
``ampscope.status.prometheus.api.PrometheusClient``, the one ``ampscope status`` uses).

Reads the raw series (``ampscope_device_offences_total`` and
``ampscope_device_last_offence_timestamp_seconds``), so it works where no recording rule is
loaded, and DCGM-exporter's error fields that are not zero, kept for the GPUs found. Three
instant queries in all, in parallel. Works against Prometheus, VictoriaMetrics and Thanos or
Mimir query frontends (``/api/v1/query`` only).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ampscope.status.shapes import Malformed

DCGM_FIELDS = (
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
)
"""DCGM-exporter fields that say a GPU is failing: the last XID error, double-bit ECC errors
(volatile and aggregate) and row remapping (rows remapped for uncorrectable errors, a failed
remap). Read for the devices found, by their ``UUID`` label."""

DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
"""A PromQL duration: ``30d``, ``12h``, ``1d12h``."""


@dataclass(frozen=True)
class Sample:
    """One sample of an instant vector: its labels and value."""

    labels: dict[str, str]
    value: float


def offences_query(since: str) -> str:
    """Offences per run, device, node and kind: the highest count within ``since``."""
    return (
        f"max by (device, node, run, kind) (max_over_time(ampscope_device_offences_total[{since}]))"
    )


def last_offence_query(since: str) -> str:
    """Per run, device and node: the time of the newest offence within ``since``."""
    return (
        "max by (device, node, run) "
        f"(max_over_time(ampscope_device_last_offence_timestamp_seconds[{since}]))"
    )


def dcgm_query() -> str:
    """Every GPU's ``DCGM_FIELDS`` that are not zero now, labelled with ``field``: one
    selector, whatever the number of GPUs (VictoriaMetrics refuses queries over 16 KiB, so
    the UUIDs are matched here, not in the query). Current values: the ECC and remapping
    fields are cumulative, and the XID field holds the last XID until the driver resets it."""
    names = "|".join(DCGM_FIELDS)
    return f'label_replace({{__name__=~"{names}"}}, "field", "$1", "__name__", "(.+)") > 0'


def samples_of(results: list[dict[str, Any]]) -> list[Sample]:
    """The samples of an instant vector (``PrometheusClient.query``'s answer, its shape
    already checked), their values parsed (``NaN`` and ``±Inf`` as floats)."""
    return [Sample(dict(item["metric"]), float(item["value"][1])) for item in results]


def require(samples: list[Sample], where: str, labels: Sequence[str]) -> list[Sample]:
    """``samples``, once each has ``labels`` and a finite value.

    Raises:
        Malformed: naming ``where`` (the query) and the first sample at fault.
    """
    for index, sample in enumerate(samples):
        missing = [name for name in labels if name not in sample.labels]
        if missing:
            raise Malformed(where, f"data.result[{index}] has no {', '.join(missing)} label")
        if not math.isfinite(sample.value):
            raise Malformed(
                where, f"data.result[{index}].value[1] is {sample.value}, not a finite number"
            )
    return samples
