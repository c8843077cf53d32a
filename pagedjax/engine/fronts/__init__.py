"""Engines made of engines: data-parallel replicas behind one router
(``data_parallel``, ``router``) and one engine spread over hosts (``multihost``)."""
