"""Workloads: synthetic ShareGPT/Alpaca lengths, arrival processes, dataset and trace loaders,
multi-turn / agentic conversations and conversation traces (prefix reuse)."""

from pagedjax.workloads.arrivals import arrival_times, arrivals_until, interarrival_gaps
from pagedjax.workloads.azure import DEFAULT_AZURE_CONV_PATH, load_azure_conv, load_trace
from pagedjax.workloads.builder import make_workload
from pagedjax.workloads.conversations import ConversationWorkload, agentic, multi_turn
from pagedjax.workloads.lengths import LENGTH_SPECS, calibrate_mu, sample_lengths, valid_pairs
from pagedjax.workloads.record import Workload
from pagedjax.workloads.sharegpt import ShareGPTSample, load_sharegpt
from pagedjax.workloads.trace_jsonl import load_conversation_trace, write_conversation_trace

__all__ = [
    "ConversationWorkload",
    "DEFAULT_AZURE_CONV_PATH",
    "LENGTH_SPECS",
    "ShareGPTSample",
    "Workload",
    "agentic",
    "arrival_times",
    "arrivals_until",
    "calibrate_mu",
    "interarrival_gaps",
    "load_azure_conv",
    "load_conversation_trace",
    "load_sharegpt",
    "load_trace",
    "make_workload",
    "multi_turn",
    "sample_lengths",
    "valid_pairs",
    "write_conversation_trace",
]
