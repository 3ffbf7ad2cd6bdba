"""Benchmarks: `charioteer bench serve` (latency under load) and `bench capacity` (rate at an SLO)."""
