"""Devices ranked by runs from Prometheus samples, and their DCGM errors: pure functions."""

from __future__ import annotations

from ampscope.devices.query import Sample, dcgm_query, last_offence_query, offences_query
from ampscope.devices.ranking import add_dcgm, rank


def _offence(run: str, device: str, node: str, kind: str, count: float) -> Sample:
    return Sample({"run": run, "device": device, "node": node, "kind": kind}, count)


def _last(run: str, device: str, node: str, when: float) -> Sample:
    return Sample({"run": run, "device": device, "node": node}, when)


OFFENCES = [
    _offence("r1", "GPU-a", "n1", "nonfinite_origin", 2),
    # Older exporters' origin_outlier series (Prometheus keeps them 30 days): no offence, so
    # r2, where GPU-a only stood out, is no run of its offences.
    _offence("r2", "GPU-a", "n1", "origin_outlier", 1),
    _offence("r3", "GPU-a", "n1", "nonfinite_origin", 1),
    _offence("r3", "GPU-a", "n1", "origin_outlier", 4),
    _offence("r5", "GPU-a", "n1", "replica_divergence", 1),
    _offence("r2", "n2:0", "n2", "nonfinite_origin", 7),
    _offence("r1", "GPU-b", "n1", "nonfinite_origin", 1),
    _offence("r4", "GPU-b", "n1", "transient_fault", 1),
    _offence("r4", "GPU-b", "n1", "future_kind", 2),  # a kind from a newer exporter
    _offence("r9", "GPU-z", "n3", "nonfinite_origin", 0),  # not an offence
]
LAST = [
    _last("r1", "GPU-a", "n1", 100.0),
    _last("r3", "GPU-a", "n1", 300.0),
    _last("r2", "GPU-a", "n1", 200.0),
    _last("r2", "n2:0", "n2", 250.0),
]


def test_devices_are_ranked_by_runs_then_offences() -> None:
    devices = rank(OFFENCES, LAST, min_runs=2)
    assert [d.as_json() for d in devices] == [
        {
            "device": "GPU-a",
            "node": "n1",
            "nodes": ["n1"],
            "hostname": None,
            "runs": 3,
            "run_ids": ["r1", "r3", "r5"],
            "offences": {
                "nonfinite_origin": 3,
                "transient_fault": 0,
                "replica_divergence": 1,
            },
            "last_run": "r3",
            "last_offence_time": 300.0,
            "dcgm": {},
            "flagged": True,
        },
        {
            "device": "GPU-b",
            "node": "n1",
            "nodes": ["n1"],
            "hostname": None,
            "runs": 2,
            "run_ids": ["r1", "r4"],
            "offences": {
                "nonfinite_origin": 1,
                "transient_fault": 1,
                "replica_divergence": 0,
                "future_kind": 2,
            },
            # No exporter said when: the last run id.
            "last_run": "r4",
            "last_offence_time": None,
            "dcgm": {},
            "flagged": True,
        },
        {
            "device": "n2:0",
            "node": "n2",
            "nodes": ["n2"],
            "hostname": None,
            "runs": 1,
            "run_ids": ["r2"],
            "offences": {
                "nonfinite_origin": 7,
                "transient_fault": 0,
                "replica_divergence": 0,
            },
            "last_run": "r2",
            "last_offence_time": 250.0,
            "dcgm": {},
            "flagged": False,
        },
    ]
    assert [d.flagged for d in rank(OFFENCES, LAST, min_runs=3)] == [True, False, False]
    assert rank([], LAST, min_runs=2) == []


def test_a_gpu_is_one_device_whatever_its_node_label() -> None:
    """On Kubernetes without AMPSCOPE_NODE the node label is the pod's name, new in every
    run: the GPU's UUID still names one device, offending in both runs; its node is that of
    its newest offence."""
    offences = [
        _offence("r1", "GPU-a", "train-r1-worker-0", "nonfinite_origin", 1),
        _offence("r2", "GPU-a", "train-r2-worker-3", "nonfinite_origin", 2),
    ]
    last = [
        _last("r1", "GPU-a", "train-r1-worker-0", 100.0),
        _last("r2", "GPU-a", "train-r2-worker-3", 200.0),
    ]
    (device,) = rank(offences, last, min_runs=2)
    assert (device.device, device.runs, device.flagged) == ("GPU-a", ["r1", "r2"], True)
    assert device.nodes == ["train-r1-worker-0", "train-r2-worker-3"]
    assert (device.node, device.last_run) == ("train-r2-worker-3", "r2")
    # Without times: the node of the last run.
    (untimed,) = rank(offences, [], min_runs=2)
    assert untimed.node == "train-r2-worker-3"


def test_dcgm_joins_both_spellings_and_leaves_out_series_without_a_uuid() -> None:
    """dcgm-exporter's releases write UUID and Hostname; its main branch hostname; with
    --use-old-namespace, uuid. A series with no UUID at all is returned, not a failure."""
    devices = rank(
        [
            _offence("r1", "GPU-a", "n1", "nonfinite_origin", 1),
            _offence("r1", "GPU-b", "n2", "nonfinite_origin", 1),
            _offence("r1", "GPU-c", "n3", "nonfinite_origin", 1),
        ],
        [],
        min_runs=1,
    )
    stray = Sample({"field": "DCGM_FI_DEV_XID_ERRORS", "gpu": "0"}, 43.0)
    left_out = add_dcgm(
        devices,
        [
            Sample({"UUID": "GPU-a", "Hostname": "host-a", "field": "DCGM_FI_DEV_XID_ERRORS"}, 79),
            Sample(
                {"UUID": "GPU-b", "hostname": "gpu-node-7", "field": "DCGM_FI_DEV_XID_ERRORS"}, 48
            ),
            Sample({"uuid": "GPU-c", "Hostname": "host-c", "field": "DCGM_FI_DEV_XID_ERRORS"}, 31),
            stray,
        ],
    )
    assert left_out == [stray]
    assert [(d.device, d.hostname, d.dcgm) for d in devices] == [
        ("GPU-a", "host-a", {"DCGM_FI_DEV_XID_ERRORS": 79}),
        ("GPU-b", "gpu-node-7", {"DCGM_FI_DEV_XID_ERRORS": 48}),
        ("GPU-c", "host-c", {"DCGM_FI_DEV_XID_ERRORS": 31}),
    ]


def test_dcgm_errors_go_to_the_gpus_they_name() -> None:
    devices = rank(OFFENCES, LAST, min_runs=2)
    add_dcgm(
        devices,
        [
            Sample({"UUID": "GPU-a", "field": "DCGM_FI_DEV_XID_ERRORS"}, 79.0),
            Sample({"UUID": "GPU-a", "field": "DCGM_FI_DEV_ROW_REMAP_FAILURE"}, 0.0),
            Sample({"UUID": "GPU-c", "field": "DCGM_FI_DEV_XID_ERRORS"}, 13.0),
        ],
    )
    assert [d.dcgm for d in devices] == [{"DCGM_FI_DEV_XID_ERRORS": 79.0}, {}, {}]


def test_queries_read_the_raw_series() -> None:
    assert offences_query("30d") == (
        "max by (device, node, run, kind) (max_over_time(ampscope_device_offences_total[30d]))"
    )
    assert "ampscope_device_last_offence_timestamp_seconds[7d]" in last_offence_query("7d")
    # One selector for every GPU's non-zero error fields, whatever the fleet's size.
    assert dcgm_query() == (
        'label_replace({__name__=~"DCGM_FI_DEV_XID_ERRORS|DCGM_FI_DEV_ECC_DBE_VOL_TOTAL|'
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL|DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS|"
        'DCGM_FI_DEV_ROW_REMAP_FAILURE"}, "field", "$1", "__name__", "(.+)") > 0'
    )


def test_the_kinds_always_listed_are_the_exporters() -> None:
    from ampscope.devices.ranking import KINDS, RETIRED_KINDS
    from ampscope.exporter.metrics.catalogue import OFFENCE_KINDS, RETIRED_OFFENCE_KINDS

    assert KINDS == OFFENCE_KINDS
    assert RETIRED_KINDS == RETIRED_OFFENCE_KINDS
    assert not set(KINDS) & set(RETIRED_KINDS)


def test_origin_outliers_alone_make_no_offender() -> None:
    # Two healthy runs whose last rank got the epoch's 1-sample remainder: an old exporter
    # exported an origin_outlier offence for each. Its device offended in no run.
    healthy = [
        _offence("origin-uneven-0", "vm:2", "vm", "origin_outlier", 1),
        _offence("origin-uneven-1", "vm:2", "vm", "origin_outlier", 1),
    ]
    assert rank(healthy, [_last("origin-uneven-1", "vm:2", "vm", 5.0)], min_runs=2) == []
    # A fault in one of the runs is that one run.
    (device,) = rank([*healthy, _offence("origin-uneven-1", "vm:2", "vm", "transient_fault", 1)],
                     [], min_runs=2)  # fmt: skip
    assert (device.runs, device.flagged) == (["origin-uneven-1"], False)
    assert device.offences == {"nonfinite_origin": 0, "transient_fault": 1,
                               "replica_divergence": 0}  # fmt: skip
