"""Benchmarks: the host measured side by side with its peers (see BENCHMARKS.md)."""
