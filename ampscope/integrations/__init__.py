"""One line per training library, each importing its library only when used.

* ``ampscope.integrations.transformers.instrument(trainer)``: Hugging Face ``Trainer``;
* ``ampscope.integrations.accelerate.instrument(accelerator)``: Accelerate;
* ``ampscope.integrations.lightning.AmpscopeCallback()``: PyTorch Lightning;
* ``ampscope.integrations.olmo_core.AmpscopeCallback()``: OLMo-core's trainer;
* ``--override.imports ampscope.integrations.torchtitan.gradwatch``: torchtitan;
* ``ampscope.integrations.deepspeed.instrument(engine)``: DeepSpeed (also what the
  Trainer and Accelerate integrations do when they run on DeepSpeed).

Each swaps the library's loss scaler for ampscope's twin of it (same class, same scaling
settings, so numerics do not change), attaches it to the wrapped model (origin tracking
on when the run is distributed), and exposes the ampscope scaler. Where the library trains
in bf16 or fp32 without a loss scaler, each installs a :class:`~ampscope.GradWatch` in its
place (``policy="observe"`` by default: numerics unchanged) and exposes that. Elsewhere
(fp16 that the library refused on CPU) they say so once and change nothing: an
integration never turns loss scaling on by itself. DeepSpeed's engine scales, checks and
skips inside itself: it is observed, never swapped. OLMo-core and torchtitan train bf16
without a scaler: theirs always install a watch.

Batch ids: the Trainer and Lightning integrations note the ids of a batch that is a mapping
holding ``"sample_ids"`` (:data:`BATCH_IDS_KEY`, each takes another key) by themselves; an
Accelerate loop does it in one line with :func:`note_ids`. :class:`IdsAsList` wraps a
collator so that the ids stay on the host when the library moves the batch to the device.
"""

from ampscope.integrations._batch import BATCH_IDS_KEY, IdsAsList, note_ids

__all__ = ["BATCH_IDS_KEY", "IdsAsList", "note_ids"]
