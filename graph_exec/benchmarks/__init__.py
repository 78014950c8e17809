"""Benchmark scripts: each prints ratios measured side by side in one run (machines are noisy).

Run one with ``python -m graph_exec.benchmarks.<name>``; none of them is a test.
"""
