"""Engines made of engines: data-parallel replicas behind one router
(``data_parallel``, ``router``), one engine spread over hosts (``multihost``), and the
server over several nodes (``multinode``)."""
