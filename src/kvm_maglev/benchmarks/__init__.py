"""Benchmarks: decode speed, prefill time and cache size of KVM, Maglev and baselines."""
