"""Benchmarks and reports: `tridist bench ...`."""
