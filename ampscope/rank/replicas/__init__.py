"""Replicas that stop agreeing: silent corruption, found by comparing parameters.

``fingerprint.py`` (exact fingerprints of the bits, on the device), ``groups.py`` (which
ranks hold the same values, per parallelism), ``check.py`` (the check every ``N``
iterations and what it concludes). docs/silent-corruption.md explains what is compared.
"""
