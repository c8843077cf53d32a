"""Tools built on the engine that are not part of it: ``python -m pagedjax.tools.bench``
(throughput on this device) and ``python -m pagedjax.tools.train_eagle`` (an EAGLE head)."""
