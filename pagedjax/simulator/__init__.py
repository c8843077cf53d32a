"""Simulated execution: step-time cost models (and, later, the trace simulator)."""
