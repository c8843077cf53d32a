"""Moved to ``pagedjax/tools/offline_throughput.py``
(``python -m pagedjax.tools.offline_throughput``), so that ``python -m pagedjax.gpu_check``
runs it from an installed wheel; this file keeps ``python benchmarks/offline_throughput.py
...`` working."""

from pagedjax.tools.offline_throughput import *  # noqa: F403
from pagedjax.tools.offline_throughput import main

if __name__ == "__main__":
    raise SystemExit(main())
