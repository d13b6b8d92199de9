"""``ampscope.integrations.accelerate.instrument`` with the real Accelerate."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from checks import check_exporter, check_origin, check_same_training, check_watch, expected_skips
from support import need_module, run_distributed
from watch_workers import accelerate_worker as accelerate_watch_worker
from watch_workers import reset_accelerate
from workers import INJECT_STEPS, STEPS, Net, accelerate_worker, batch

need_module("accelerate")


def test_accelerate_single_process(report_to: str) -> None:
    result = accelerate_worker(0, 1, "acc-single")
    for mode in ("before", "after"):
        ours = result[mode]
        check_same_training(result["stock"], ours)
        assert ours["optimizer_scaler_is_accelerators"]
        assert ours["nonfinite"][min(INJECT_STEPS)] == ["head.weight"]
        assert ours["origin"] == [False] * STEPS  # one process: nothing to track
        check_exporter(report_to, f"acc-single-{mode}", [ours])


@pytest.mark.distributed
def test_accelerate_ddp_two_ranks(report_to: str) -> None:
    results = run_distributed(accelerate_worker, 2, args=("acc-ddp",))
    for rank_result in results:
        for mode in ("before", "after"):
            check_same_training(rank_result["stock"], rank_result[mode])
            assert rank_result[mode]["optimizer_scaler_is_accelerators"]
    # Before prepare(): attached to the DDP wrapper, so origin names rank 1.
    check_origin([r["before"] for r in results])
    check_exporter(report_to, "acc-ddp-before", [r["before"] for r in results])
    # After prepare(): Accelerate kept only the unwrapped module; names, no origin.
    assert all(r["after"]["origin"] == [False] * STEPS for r in results)
    # The all-reduce spreads the inf: both ranks name the parameter, either way.
    for rank_result in results:
        for mode in ("before", "after"):
            assert rank_result[mode]["nonfinite"][min(INJECT_STEPS)] == ["head.weight"]
    check_exporter(report_to, "acc-ddp-after", [r["after"] for r in results])


def test_accelerate_without_a_scaler_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    from accelerate import Accelerator

    from ampscope.integrations.accelerate import instrument

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)  # CPU: no scaler, fp32
    with caplog.at_level(logging.WARNING, logger="ampscope"):
        assert instrument(accelerator, reporter=None) is None
        assert instrument(accelerator, reporter=None) is None
    assert accelerator.scaler is None
    messages = [r.getMessage() for r in caplog.records if "no loss scaler" in r.getMessage()]
    assert len(messages) == 1
    assert "mixed_precision='fp16' on cpu" in messages[0]


def test_accelerate_rejects_scaling_options() -> None:
    from accelerate import Accelerator

    from ampscope.integrations.accelerate import instrument

    with pytest.raises(TypeError, match="init_scale"):
        instrument(Accelerator(cpu=True), init_scale=4.0)


def test_expected_skips_cover_the_injected_steps() -> None:
    assert sum(expected_skips()) == len(INJECT_STEPS)


def test_fsdp_scalers_keep_the_class_accelerate_chose() -> None:
    """Neither FSDP version runs on CPU in Accelerate (its FSDP plugin falls back to
    MULTI_CPU there), so this checks the swap on the scalers Accelerate's own factories
    build for FSDP1 (``ShardedGradScaler``) and FSDP2 (``torch.amp.GradScaler``)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, get_grad_scaler
    from accelerate.utils.fsdp_utils import get_fsdp2_grad_scaler

    import ampscope
    from ampscope.integrations.accelerate import instrument

    factories = {
        ampscope.ShardedGradScaler: lambda: get_grad_scaler(
            # On a GPU Accelerate passes no device (torch's default "cuda").
            DistributedType.FSDP,
            device="cpu",
            init_scale=64.0,
            growth_interval=7,
        ),
        ampscope.GradScaler: lambda: get_fsdp2_grad_scaler(
            device="cpu", init_scale=64.0, growth_interval=7
        ),
    }
    for expected, factory in factories.items():
        accelerator = Accelerator(cpu=True)
        accelerator.scaler = factory()
        scaler = instrument(accelerator, reporter=None)
        assert type(scaler) is expected
        assert accelerator.scaler is scaler
        assert (scaler.get_scale(), scaler.get_growth_interval()) == (64.0, 7)
        scaler.close()


@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_accelerate_bf16_and_fp32_get_a_watch(precision: str) -> None:
    result = accelerate_watch_worker(0, 1, "acc-watch")[precision]
    check_watch(result)
    for run in ("observe", "skip"):
        assert result[run]["is_accelerators"]
    # Accelerate's own notion of a skipped step is what held its scheduler.
    assert result["skip"]["step_was_skipped"] == expected_skips()
    assert result["observe"]["step_was_skipped"] == [False] * STEPS


@pytest.mark.distributed
def test_accelerate_watch_ddp_two_ranks() -> None:
    results = run_distributed(accelerate_watch_worker, 2, args=("acc-watch-ddp",))
    for rank, rank_result in enumerate(results):
        for precision in ("bf16", "no"):
            check_watch(rank_result[precision], rank, 2)
            assert rank_result[precision]["skip"]["step_was_skipped"] == expected_skips()


def test_accelerate_rejects_an_unknown_policy() -> None:
    from accelerate import Accelerator

    from ampscope.integrations.accelerate import instrument

    with pytest.raises(ValueError, match="policy must be one of"):
        instrument(Accelerator(cpu=True), policy="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="applies to policy 'skip'"):
        instrument(Accelerator(cpu=True), max_consecutive_skips=3)


def test_accelerate_watch_after_prepare_reaches_the_prepared_optimizer() -> None:
    """instrument() after prepare(): the optimizer wrapper built without a scaler is set up
    to step through the watch, and Accelerate's step_was_skipped sees its skips."""
    import torch
    from accelerate import Accelerator
    from watch_workers import reset_accelerate
    from workers import Net, batch, poison

    from ampscope.integrations.accelerate import instrument

    reset_accelerate()
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = Net()
    poison(model, 0, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    assert optimizer.scaler is None
    watch = instrument(accelerator, policy="skip", reporter=None)
    assert optimizer.scaler is watch
    assert accelerator.scaler is watch
    skipped = []
    for step in range(STEPS):
        accelerator.backward(model(batch(0, step)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        skipped.append(optimizer.step_was_skipped)
    assert skipped == expected_skips()
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    watch.close()
    reset_accelerate()


def _train_noting_ids(rows: list[Any], **note: Any) -> list[Any]:
    """Three bf16 updates of two micro-batches of two rows, the loop noting each
    micro-batch's ids in one line; each update's ``batch``."""
    import torch
    from accelerate import Accelerator
    from watch_workers import reset_accelerate

    from ampscope.integrations.accelerate import instrument, note_ids

    reset_accelerate()
    accelerator = Accelerator(mixed_precision="bf16", cpu=True, gradient_accumulation_steps=2)
    watch = instrument(accelerator, reporter=None)
    assert watch is not None
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(rows, batch_size=2)  # type: ignore[arg-type]
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for micro_batch in loader:
        with accelerator.accumulate(model):
            note_ids(watch, micro_batch, **note)
            accelerator.backward(model(micro_batch["x"]).square().mean())
            optimizer.step()
            optimizer.zero_grad()
    watch.close()
    return [record.batch for record in watch.telemetry.history()]


@pytest.mark.usefixtures("fresh_accelerate")
def test_accelerate_loop_notes_the_ids_a_batch_carries() -> None:
    rows = [{"x": batch(0, index)[0], "sample_ids": 1000 + index} for index in range(12)]
    batches = _train_noting_ids(rows)
    assert [(b.ids, b.left_out) for b in batches] == [
        (list(range(start, start + 4)), 0) for start in (1000, 1004, 1008)
    ]
    assert _train_noting_ids(rows, key="doc") == [None] * 3
    assert _train_noting_ids(rows, key=None) == [None] * 3


def test_accelerates_device_move_leaves_ids_collated_as_a_list() -> None:
    # What the prepared data loader does to each batch (the meta device stands in for a
    # GPU): tensors move, a list of ids stays on the host, where note_ids reads it.
    import torch
    from accelerate.utils import send_to_device

    moved = send_to_device({"x": torch.ones(2), "sample_ids": [7, 8]}, torch.device("meta"))
    assert moved["x"].device.type == "meta"
    assert moved["sample_ids"] == [7, 8]


def _clipping_loop(precision: str, instrumented: bool, norm_passes: list[int]) -> dict[str, Any]:
    """Accelerate's documented loop with ``accelerator.clip_grad_norm_`` (a max norm that
    clips), fp16 set up as on a GPU, or bf16/fp32 with a watch. ``norm_passes`` counts
    ampscope's own norm passes (the spy below)."""
    from accelerate import Accelerator
    from workers import as_on_gpu

    from ampscope.integrations.accelerate import instrument

    reset_accelerate()
    accelerator = Accelerator(mixed_precision=precision, cpu=True)
    if precision == "fp16":
        as_on_gpu(accelerator)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    front = instrument(accelerator, reporter=None) if instrumented else None
    model, optimizer = accelerator.prepare(model, optimizer)
    totals: list[float] = []
    for step in range(6):
        loss = model(batch(0, step)).square().mean() * 40.0
        accelerator.backward(loss)
        totals.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    records = front.telemetry.history() if front is not None else []
    if front is not None:
        front.close()
    return {"totals": totals, "params": params, "records": records, "passes": list(norm_passes)}


@pytest.mark.parametrize("precision", ["fp16", "bf16", "no"])
def test_accelerate_clip_gives_the_records_norms_without_a_pass_of_its_own(
    precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``accelerator.clip_grad_norm_`` (what the ``Trainer`` calls) goes through the
    front-end's clip: the same totals and weights as Accelerate's own, the records' norms
    are the clip's, and from the second iteration ampscope runs no norm pass of its own."""
    from ampscope.rank.gradients import norm_batches

    passes: list[int] = []
    own_pass = norm_batches.NormBatches.norms

    def counted(self: Any, *args: Any) -> Any:
        passes.append(1)
        return own_pass(self, *args)

    stock = _clipping_loop(precision, False, passes)
    monkeypatch.setattr(norm_batches.NormBatches, "norms", counted)
    ours = _clipping_loop(precision, True, passes)
    assert ours["totals"] == stock["totals"]
    assert all(torch.equal(a, b) for a, b in zip(ours["params"], stock["params"], strict=True))
    assert max(stock["totals"]) > 0.5, "the clip clipped"
    assert [r.stats.grad_norm for r in ours["records"]] == pytest.approx(ours["totals"], rel=1e-6)
    assert len(ours["passes"]) <= 1, "only the first iteration, before the loop clipped once"


def test_accelerate_clip_on_every_micro_batch_still_skips_a_nan_one() -> None:
    """bf16 loops may clip on every micro-batch of an accumulation (stock Accelerate
    allows it there): the clip of a micro-batch that does not sync is Accelerate's own, so
    the watch checks the whole gradient at the sync step and skips the NaN it holds."""
    from accelerate import Accelerator

    from ampscope.integrations.accelerate import instrument

    reset_accelerate()
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True, gradient_accumulation_steps=2)
    watch = instrument(accelerator, policy="skip", reporter=None)
    assert watch is not None
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    for x in (torch.randn(3, 4), torch.full((3, 4), float("nan"))):  # the second syncs
        with accelerator.accumulate(model):
            accelerator.backward(model(x).square().mean())
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    assert optimizer.step_was_skipped
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    (record,) = watch.telemetry.history()
    assert record.skipped
    assert any(record.found_inf_local.values())
    watch.close()


def test_accelerate_clip_checks_only_the_clipped_parameters_optimizer() -> None:
    """Two models, two optimizers, each clipped after its own backward: the first clip
    must not check the second optimizer, whose gradients (NaN here) are not there yet."""
    from accelerate import Accelerator

    from ampscope.integrations.accelerate import instrument

    reset_accelerate()
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    watch = instrument(accelerator, policy="skip", reporter=None)
    assert watch is not None
    a, b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    a, b, opt_a, opt_b = accelerator.prepare(a, b, opt_a, opt_b)
    accelerator.backward(a(torch.randn(3, 4)).square().mean())
    accelerator.clip_grad_norm_(a.parameters(), 1.0)
    accelerator.backward(b(torch.full((3, 4), float("nan"))).square().mean())
    accelerator.clip_grad_norm_(b.parameters(), 1.0)
    opt_b.step()
    opt_a.step()
    assert opt_b.step_was_skipped
    assert all(bool(p.isfinite().all()) for p in b.parameters())
    watch.close()
