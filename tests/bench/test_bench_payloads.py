"""bench.payloads: simulated ranks send what real ranks send, in both formats."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ampscope.exporter.metrics.catalogue import BY_NAME
from ampscope.reporter.schema import SCALE_ALIGN_STEPS
from bench.payloads import PUSHED_FAMILIES, SimulatedRank, check_batch


def test_batches_pass_the_exporters_strict_validation_and_keep_counting() -> None:
    rank = SimulatedRank(run="bench", rank=9, world_size=64, devices=8, top_k=8, overflow_every=10)
    first = check_batch(rank.ingest_batch(25))
    second = check_batch(rank.ingest_batch(5))
    records = [*first.records, *second.records]
    assert [r.step for r in records] == list(range(1, 31))
    assert {(r.identity.node, r.identity.local_rank) for r in records} == {("node1", 1)}
    events = {r.step: r.event for r in records if r.event != "none"}
    assert events == {
        5: "growth",
        10: "backoff",
        15: "growth",
        20: "backoff",
        25: "growth",
        30: "backoff",
    }
    overflow = records[9]
    assert overflow.skipped
    assert overflow.found_inf_global
    assert sum(overflow.found_inf_local.values()) == 1
    assert len(overflow.nonfinite_params) == 2
    assert overflow.scale_after == overflow.scale_before / 2
    clean = records[10]
    assert not clean.skipped
    assert clean.nonfinite_params == []
    assert len(clean.found_inf_local) == 8
    assert not any(clean.found_inf_local.values())
    # Template-rendered records carry the live totals, not the template's.
    last = records[-1]
    assert last.totals.steps == 30
    assert (last.totals.skipped_steps, last.totals.backoffs, last.totals.growths) == (3, 3, 3)
    assert len(last.totals.nonfinite_params) == 8
    assert records[11].totals.steps == 12
    assert records[11].scale_after == records[11].scale_before
    assert records[8].totals.aligned_scale is None
    aligned = {r.step: r.totals.aligned_scale for r in records[9:]}
    assert all(a is not None and a.step == s - s % SCALE_ALIGN_STEPS for s, a in aligned.items())
    assert all(
        a is not None and a.scale == records[a.step - 1].scale_after for a in aligned.values()
    )


def test_exposition_has_the_exporters_families_and_label_sets() -> None:
    rank = SimulatedRank(run="bench", rank=3, world_size=8, devices=4, top_k=6)
    rank.ingest_batch(150)
    families = {
        f.name: f for f in text_string_to_metric_families(rank.exposition(dropped=7).decode())
    }
    # The parser strips _total from counter family names.
    names = {spec.name.removesuffix("_total") for spec in PUSHED_FAMILIES}
    assert set(families) == names
    for spec in PUSHED_FAMILIES:
        family = families[spec.name.removesuffix("_total")]
        assert family.type == spec.type == BY_NAME[spec.name].type
        for sample in family.samples:
            # run and rank come from the push's grouping key.
            expected = set(spec.labels) - {"run", "rank"}
            assert set(sample.labels) == expected, spec.name
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    base = (("local_rank", "3"), ("node", "node0"))
    assert samples[("ampscope_steps_total", base)] == 150
    assert samples[("ampscope_skipped_steps_total", base)] == 1
    assert samples[("ampscope_reporter_dropped_records_total", base)] == 7
    assert len(families["ampscope_found_inf"].samples) == 4
    assert len(families["ampscope_nonfinite_grads"].samples) == 6
    assert rank.push_path() == "/metrics/job/ampscope/run/bench/rank/3"
