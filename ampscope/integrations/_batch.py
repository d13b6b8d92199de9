"""The batch ids an integration notes by itself: one documented key, read one way.

A batch that is a mapping (the Trainer's, most Accelerate and Lightning loops') and holds
:data:`BATCH_IDS_KEY` carries its samples' ids there; the integrations pass them to the
front-end's ``note_batch`` once per micro-batch. Nothing else is read, and the user's batch
is never changed: where the model must not receive the key (the Trainer unpacks the batch
into ``model(**inputs)``), the integration hands on a shallow copy without it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from ampscope.rank.frontends.base import TelemetryFrontEnd

_CPU = torch.device("cpu")

BATCH_IDS_KEY = "sample_ids"
"""The default key of a batch's sample ids (each integration takes another name)."""


def check_key(key: str | None) -> str | None:
    """Validate an integration's ``batch_ids_key`` where the user passed it.

    Raises:
        TypeError: neither a string nor ``None``.
        ValueError: an empty string.
    """
    if key is not None and not isinstance(key, str):
        raise TypeError(f"batch_ids_key must be a str or None, not {type(key).__name__}")
    if key == "":
        raise ValueError("batch_ids_key must not be empty (None turns the ids off)")
    return key


def carries_ids(batch: Any, key: str | None) -> bool:
    """Whether ``batch`` is a mapping that holds ``key``."""
    return key is not None and isinstance(batch, Mapping) and key in batch


def note_ids(
    front_end: TelemetryFrontEnd | None, batch: Any, key: str | None = BATCH_IDS_KEY
) -> None:
    """Note the ids ``batch`` carries under ``key`` for the current iteration; nothing when
    it is not a mapping holding ``key``, or ``front_end`` is ``None``.

    Call once per micro-batch, before that micro-batch's ``update()``. Costs a dict lookup and
    ``note_batch``'s list append: a list of ints or strings is kept as is, a CPU tensor read
    with ``tolist()``; a tensor on an accelerator is never read (that would wait for the
    device) and its elements are counted as left out, so collate ids as a list, or read them
    before the batch moves to the device.

    Args:
        front_end: The scaler or watch an integration returned.
        batch: The batch the loop trains on.
        key: The batch's key of the ids; ``None`` notes nothing.
    """
    if front_end is not None and carries_ids(batch, key):
        front_end.note_batch(batch[key])


def without_key(batch: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """A shallow copy of ``batch`` without ``key``, of the same mapping type where it can be
    copied (a ``dict``, a Hugging Face ``BatchEncoding``); the values are shared, not copied."""
    if type(batch) is dict:
        return {name: value for name, value in batch.items() if name != key}
    try:
        shallow = copy.copy(batch)
    except Exception:  # a mapping that cannot be copied: a plain dict then
        shallow = batch
    if isinstance(shallow, MutableMapping) and shallow is not batch:
        del shallow[key]
        return shallow
    return {name: value for name, value in batch.items() if name != key}


class IdsAsList:
    """A collator whose batches carry the ids under ``key`` as a list of Python ints.

    Wraps a data collator (which runs in the data loader, before the batch moves to the
    device): a tensor of ids in the collated batch becomes ``tensor.tolist()``, which the
    device move leaves where it is, so ``note_batch`` can read it without waiting for the
    device. Changes only the collator's own fresh output; picklable for loader workers.

    Args:
        collate: The collator to wrap.
        key: The batch's key of the ids (default ``"sample_ids"``).
    """

    def __init__(self, collate: Any, key: str = BATCH_IDS_KEY) -> None:
        self.collate = collate
        self.key = key

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        batch = self.collate(*args, **kwargs)
        if isinstance(batch, MutableMapping) and self.key in batch:
            ids = batch[self.key]
            # Only on the CPU: a collator that put the ids on a device would make this wait.
            if hasattr(ids, "tolist") and getattr(ids, "device", None) == _CPU:
                batch[self.key] = ids.reshape(-1).tolist()
        return batch
