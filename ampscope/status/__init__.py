"""``ampscope status``: how are the runs on this node doing, from a terminal or a script.

``render`` formats the exporter's JSON as tables (pure functions, tested without a
server); ``main`` is the command: it fetches, prints, and exits with the health status.
"""
