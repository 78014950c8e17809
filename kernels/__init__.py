"""Compute graphs shared by the graph and pynative executors (installed as graph_exec.kernels)."""
