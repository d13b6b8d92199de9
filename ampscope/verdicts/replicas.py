"""The replica rule over a neutral view of each rank's replica checks (``ReplicaFacts``):
``replica_divergence``.

With ``attach(model, replica_check_every=N)`` the ranks that must hold the same parameter
values (data-parallel replicas) compare them bit for bit every ``N`` iterations. Replicas
that disagree mean silent corruption: a device computed, stored or updated a parameter
wrongly, and nothing turned NaN. The run's weights are no longer consistent from that
check on, so the verdict is critical for as long as the ranks' current processes run.

Every rank of a replica group records the same outcome. The exporter's health feeds each
rank's first diverged check (the step, the disagreeing ranks, whether a majority agreed,
the parameters); ``ampscope status --prometheus`` feeds counts only. Pure: O(ranks), no
clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ampscope.verdicts.ranks import RankRef
from ampscope.verdicts.thresholds import Thresholds
from ampscope.verdicts.verdict import MAX_EVIDENCE_RANKS, Verdict, rule_verdicts

NEXT_STEPS = (
    "the weights are no longer consistent: restore from the last checkpoint saved before "
    "step {step}, exclude the named device (drain or cordon its node), and confirm with "
    "the vendor's diagnostics (NVIDIA: dcgmi diag -r 3, or the field diagnostic)"
)


@dataclass(frozen=True, kw_only=True)
class DivergenceDetail:
    """A rank's first replica check that diverged, where the source holds it."""

    step: int
    ranks: tuple[int, ...]
    """The disagreeing global ranks: the minority, or all of them without a majority."""
    majority: bool
    parameters: tuple[str, ...]
    parameters_differing: int = 0


@dataclass(frozen=True, kw_only=True)
class ReplicaFacts(RankRef):
    """How many of a rank's replica checks diverged, and (from an exporter) the first of
    them and the rank's device."""

    diverged: int
    first: DivergenceDetail | None = None
    device: str | None = None
    """The device the rank named (a GPU's UUID), when known."""


def _and(items: Sequence[Any]) -> str:
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _entry(rank: int, known: Mapping[int, ReplicaFacts]) -> dict[str, Any]:
    facts = known.get(rank)
    if facts is None:  # a rank another exporter holds
        return {"rank": rank}
    out = facts.ref()
    if facts.device is not None:
        out["device"] = facts.device
    return out


def replica_divergence(ranks: Sequence[ReplicaFacts], t: Thresholds) -> Verdict:
    """Critical once a replica check of any rank's current process diverged. Names the
    disagreeing ranks (the minority; both of two replicas, saying there is no majority),
    the step of the first check that disagreed and the differing parameters."""
    say = rule_verdicts("replica_divergence", t)
    hits = sorted((f for f in ranks if f.diverged > 0), key=lambda f: f.rank)
    if not hits:
        return say("ok", "every replica check agreed", {"ranks_affected": 0})
    known = {f.rank: f for f in ranks}
    details = [f.first for f in hits if f.first is not None]
    checks = sum(f.diverged for f in hits)
    if not details:  # counters only (Prometheus): the groups, not the culprit
        group = [h.rank for h in hits]
        summary = (
            f"replica checks diverged ({checks} check(s)) on rank(s) {_and(group)}: their "
            "replicas hold different parameters (silent corruption); the exporter's "
            "verdict names the disagreeing rank and parameters. " + NEXT_STEPS.format(step="it")
        )
        evidence = {
            "ranks_affected": len(hits),
            "checks_diverged": checks,
            "ranks": [_entry(r, known) for r in group][:MAX_EVIDENCE_RANKS],
        }
        return say("critical", summary, evidence)
    step = min(d.step for d in details)
    odd = sorted({r for d in details for r in d.ranks})
    majority = all(d.majority for d in details)
    in_order = sorted(details, key=lambda d: d.step)
    parameters = list(dict.fromkeys(p for d in in_order for p in d.parameters))
    named = [_entry(r, known) for r in odd]
    where = ", ".join(
        f"rank {e['rank']}" + (f" (device {e['device']})" if "device" in e else "") for e in named
    )
    what = f"parameter(s) {_and(parameters)}" if parameters else "its parameters"
    if majority:
        summary = f"{where} disagree(s) with the majority of its replicas since step {step}: "
    else:
        summary = (
            f"{where} disagree since step {step} and there is no majority among the "
            "replicas to tell which one is wrong (two replicas, or a tie): "
        )
    summary += f"{what} differ bit for bit (silent corruption, nothing is NaN); "
    summary += NEXT_STEPS.format(step=step)
    if not majority:
        summary += "; with no majority, check every named device"
    evidence = {
        "ranks_affected": len(odd),
        "step": step,
        "majority": majority,
        "parameters": parameters,
        "checks_diverged": checks,
        "ranks": named[:MAX_EVIDENCE_RANKS],
    }
    return say("critical", summary, evidence)
