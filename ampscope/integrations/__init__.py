"""One line per training library, each importing its library only when used.

* ``ampscope.integrations.transformers.instrument(trainer)``: Hugging Face ``Trainer``;
* ``ampscope.integrations.accelerate.instrument(accelerator)``: Accelerate;
* ``ampscope.integrations.lightning.AmpscopeCallback()``: PyTorch Lightning.

Each swaps the library's loss scaler for ampscope's twin of it (same class, same scaling
settings, so numerics do not change), attaches it to the wrapped model (origin tracking
on when the run is distributed), and exposes the ampscope scaler. Where the library uses
no loss scaler (bf16, fp32, or fp16 that the library refused on CPU), they say so once and
change nothing: an integration never turns loss scaling on by itself.
"""
