"""Memory management: the paged block pool, block tables and reservation baselines."""
