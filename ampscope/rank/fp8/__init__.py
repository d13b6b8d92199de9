"""FP8 training, observed per layer and per tensor (torchao's ``Float8Linear``).

A front-end's ``attach(model)`` finds the model's ``Float8Linear`` modules (torchao is
never imported here: only read through :mod:`ampscope.rank.compat` once the training
script imported it) and, every ``fp8_every`` iterations, computes for each layer and each
of its cast tensors (``input``, ``weight``, ``grad_output``) what the layer's own cast
does to it: the amax, the share of its non-zero elements that the cast turns into zero
(underflow) and the scale (tensorwise) or the largest and smallest row scale (rowwise).

``casts.py`` holds the per-tensor statistics (device ops only), ``observer.py`` the
hooks and the per-iteration values, which travel with the step's own device-to-host
copy, and ``record.py`` turns their host values into the records' ``fp8`` entries, with
the scales ``scales.py`` derives from the amaxes as torchao does (pure Python).
"""
