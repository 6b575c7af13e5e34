"""Test and documentation helpers: tiny random models for every family, offline tokenizers, a loopback NDIF server.

Nothing here is needed to attribute a real model; the test suite, the notebooks and the benchmarks import it.
"""
