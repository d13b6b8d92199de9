"""A test-only launcher: torchtitan's own ``Trainer`` and config registry on CPU ranks.

torchtitan 0.3.0 trains on accelerators; on the CPU with gloo its ``llama3_debugmodel``
trains once these patches are applied, each for one reason (a GPU run needs none):

* :func:`_cpu_device`: torchtitan picks its device type at import time as
  ``torch._utils._get_available_device_type() or "cuda"``, so on a machine without an
  accelerator it asks for CUDA. The patch answers ``"cpu"`` before torchtitan is
  imported (``torch.cpu`` has the ``set_device``/``device_count`` it calls).
* :func:`_dense_flex_attention`: the debug model's attention is FlexAttention, and
  ``flex_attention`` refuses a backward on the CPU in torch 2.13 (compiled or eager).
  The patch computes the same attention with the block mask's own ``mask_mod`` made
  dense and ``scaled_dot_product_attention``, and builds the block mask with the eager
  ``create_block_mask`` (compiling it needs a C++ build per process on the CPU).
* :func:`_gloo_reduce_scatter`: torchtitan sets FSDP2's gradient divide factor to 1 (it
  scales by the global token count itself), and FSDP2 reduces with that factor as a
  ``PREMUL_SUM`` reduce-scatter, which gloo does not implement. The patch also sets
  FSDP2's own ``set_force_sum_reduction_for_comms``: a plain ``SUM``, then a division by
  the factor 1, which is exact.
* :func:`_keep_timeouts`: after the first step torchtitan shortens the process groups'
  timeouts behind a barrier on ``device_ids=[torch.cpu.current_device()]``, which is
  the string ``"cpu"`` that the barrier refuses; the patch keeps the default timeouts.
* :class:`RandomTokens` and :class:`NoTokenizer`: the registry's ``c4_test`` data and
  tokenizer live in torchtitan's source tree, not in its wheel; the launcher feeds
  deterministic random tokens instead.

One choice on the command line rather than a patch: ``--parallelism.spmd_backend
partial_dtensor`` (the tests' ``argv``). With torchtitan's default, ``spmd_types``, FSDP
setup stops on these CPU ranks ("all parameters must be DTensors on the full SPMD mesh ...
Got plain tensor for parameter 'weight'"); the cause was not pursued. ``partial_dtensor``
is torchtitan's classic FSDP2 path.

Everything else (config parsing, ``--override.imports``, parallelisation, clipping, the
optimizers and LR schedulers containers) is torchtitan's, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 2048
"""The debug model's vocabulary."""


def _cpu_device() -> None:
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]


def _host_memory_monitor() -> None:
    from torchtitan.components import metrics

    class HostMemory:
        """What the metrics read of a device's memory; the CPU reports none."""

        device_name = "cpu"
        device_capacity_gib = 0.0

        def get_peak_stats(self) -> Any:
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.build_device_memory_monitor = HostMemory


def _dense_flex_attention() -> None:
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import AuxOutput, create_block_mask, create_mask
    from torchtitan.models.common import attention
    from torchtitan.models.common.attention import FlexAttention

    # Compiling the mask builder costs a C++ build per process on the CPU; same mask eagerly.
    attention._compiled_create_block_mask = create_block_mask

    def flex_attention_on_cpu(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        score_mod: Any,
        block_mask: Any,
        scale: float | None,
        enable_gqa: bool,
        return_aux: Any,
        kernel_options: dict[str, Any],
    ) -> tuple[torch.Tensor, AuxOutput]:
        if score_mod is not None or return_aux.lse:
            raise NotImplementedError("the CPU stand-in covers the llama3 debug model only")
        # The block mask's own mask_mod, evaluated densely (document-causal).
        mask = create_mask(
            block_mask.mask_mod, q.shape[0], None, q.shape[-2], k.shape[-2], device=q.device
        )
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out, AuxOutput()

    FlexAttention._compiled_flex_attn = flex_attention_on_cpu


def _gloo_reduce_scatter() -> None:
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import fsdp

    disable_division = fsdp.disable_fsdp_gradient_division
    if getattr(disable_division, "sums_only", False):
        return

    def sum_without_division(model: torch.nn.Module) -> None:
        disable_division(model)  # torchtitan's: a divide factor of 1 (PREMUL_SUM)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    sum_without_division.sums_only = True  # type: ignore[attr-defined]
    fsdp.disable_fsdp_gradient_division = sum_without_division


def _keep_timeouts() -> None:
    from torchtitan.distributed import utils

    def set_pg_timeouts(*args: Any, **kwargs: Any) -> None:
        pass  # the default timeouts stay

    utils.set_pg_timeouts = set_pg_timeouts


def _classes() -> tuple[type, type]:
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Any, *, tokenizer_path: str | None = None) -> None:
            super().__init__()

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return VOCAB

    class RandomTokens(BaseDataLoader):
        """Deterministic random tokens, different per rank and step, endless."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(
            self,
            config: Any,
            *,
            dp_rank: int,
            seq_len: int,
            local_batch_size: int,
            **kwargs: Any,
        ) -> None:
            self.rank, self.seq_len, self.batch = dp_rank, seq_len, local_batch_size
            self.step = 0

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            while True:
                generator = torch.Generator().manual_seed(1000 * self.step + self.rank)
                tokens = torch.randint(
                    0, VOCAB, (self.batch, self.seq_len + 1), generator=generator
                )
                self.step += 1
                # One document per row: positions from 0, as torchtitan's loaders emit.
                positions = torch.arange(self.seq_len).repeat(self.batch, 1)
                yield {"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.step = state_dict["step"]

    return NoTokenizer, RandomTokens


def build_trainer(argv: list[str], cpu: bool = True) -> Any:
    """torchtitan's ``Trainer`` for ``argv`` (its own command line), on this CPU rank;
    ``cpu=False``: on a GPU, none of the patches (only the data and tokenizer stand-ins,
    which are not in torchtitan's wheel)."""
    if cpu:
        _cpu_device()
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(argv)
    if cpu:
        _dense_flex_attention()
        _host_memory_monitor()
        _gloo_reduce_scatter()
        _keep_timeouts()
    no_tokenizer, random_tokens = _classes()
    config.tokenizer = no_tokenizer.Config()
    config.dataloader = random_tokens.Config()
    return config.build()
