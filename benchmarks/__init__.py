"""Runnable benchmarks: `python -m benchmarks.<name> --help`."""
