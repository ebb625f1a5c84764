"""Trace-driven simulation of Mooncake serving: traces, cache replay, the cluster simulator."""
