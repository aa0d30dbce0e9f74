"""Benchmarks: measured medians next to their physical floor and next to the peers, same process."""
