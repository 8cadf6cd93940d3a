"""The strategies (src/shmtrain/strategies/): the registry, each method against its
equations or single-process SGD, the transport seam, the state contract."""
