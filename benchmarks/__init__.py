"""Benchmarks: each prints ratios against the plain loop measured in the same run (never timed tests)."""
