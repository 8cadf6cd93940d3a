"""Benchmarks: OSU style (warm-up, sizes, rank 0 prints one table), JSON beside the table."""
