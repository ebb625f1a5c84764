"""Benchmarks behind `tsukimi bench ...` and the baselines they compare against."""
