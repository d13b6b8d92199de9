"""Health verdicts as pure rules over a neutral view of a run's ranks.

Imported by the exporter's health (over its store) and by ``ampscope status`` (over exporters'
answers or Prometheus series) alike; imports neither torch nor the server stack.
"""
