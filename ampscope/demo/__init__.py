"""``ampscope demo``: a small FSDP2 job trained in fp16 into instability, watched by ampscope.

Modules: ``scenarios`` (what goes wrong, as data), ``trainer`` (one rank's training loop),
``exporter`` (the ``ampscope serve`` subprocess), ``runner`` (launches the ranks and shows
progress), ``report`` (the summary read back from the exporter), ``main`` (the CLI).
"""
