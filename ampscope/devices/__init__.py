"""``ampscope devices``: which devices offended in how many runs, read from Prometheus.

``query.py`` asks Prometheus and checks the shape of its answers, ``ranking.py`` turns the
samples into devices ranked by runs (pure), ``main.py`` is the command. Imports neither
torch nor the server stack.
"""
