"""Benchmark suite for zonefs-py (issue 6): contenders, workloads, report."""
