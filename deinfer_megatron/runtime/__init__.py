"""The job runtime every rank job goes through (``job``): its options (``options``), the engine
that drives a loaded stage (``engines``) and the one plan a launched job's ranks agree on
(``agree``)."""
