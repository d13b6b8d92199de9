"""``ampscope demo``: a small FSDP2 job trained in fp16 into instability, watched by ampscope.

Modules: ``scenarios`` (what goes wrong, as data), ``trainer`` (one rank's training loop),
``exporter`` (the ``ampscope serve`` subprocess), ``runner`` (launches the ranks and shows
progress), ``report`` (the summary read back from the exporter), ``main`` (the CLI).
"""

import warnings

# torch warns on import when numpy is not installed; the demo never uses numpy, and the
# warning would print once per rank. This package is only imported by `ampscope demo`.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
