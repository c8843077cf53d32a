"""Workloads: synthetic ShareGPT/Alpaca lengths, arrival processes, dataset and trace loaders."""

from pagedjax.workloads.arrivals import arrival_times, arrivals_until, interarrival_gaps
from pagedjax.workloads.azure import DEFAULT_AZURE_CONV_PATH, load_azure_conv, load_trace
from pagedjax.workloads.builder import make_workload
from pagedjax.workloads.lengths import LENGTH_SPECS, calibrate_mu, sample_lengths, valid_pairs
from pagedjax.workloads.record import Workload
from pagedjax.workloads.sharegpt import ShareGPTSample, load_sharegpt

__all__ = [
    "DEFAULT_AZURE_CONV_PATH",
    "LENGTH_SPECS",
    "ShareGPTSample",
    "Workload",
    "arrival_times",
    "arrivals_until",
    "calibrate_mu",
    "interarrival_gaps",
    "load_azure_conv",
    "load_sharegpt",
    "load_trace",
    "make_workload",
    "sample_lengths",
    "valid_pairs",
]
