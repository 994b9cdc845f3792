"""Benchmarks: scripts that print a table and write JSON."""
