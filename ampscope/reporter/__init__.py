"""Rank-side transport: the record schema and the sinks records go to."""
