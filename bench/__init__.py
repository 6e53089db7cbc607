"""Benchmarks: run apart from the tests, each prints one comparable summary."""
