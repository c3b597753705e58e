"""The shared-memory core: layout, robust locks, segments, the registry, the ring log,
groups and leases, queue handles, the co-located transport and the server's interface
to queues (``serverqueue``)."""
