"""Command-line and network front ends: the OpenAI-compatible server, ``pagedjax`` CLI."""
