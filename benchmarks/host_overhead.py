"""Moved to ``pagedjax/tools/host_overhead.py`` (``python -m pagedjax.tools.host_overhead``),
so that ``python -m pagedjax.gpu_check`` runs it from an installed wheel; this file keeps
``python benchmarks/host_overhead.py ...`` working."""

from pagedjax.tools.host_overhead import *  # noqa: F403
from pagedjax.tools.host_overhead import main

if __name__ == "__main__":
    main()
