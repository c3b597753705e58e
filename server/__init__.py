"""The broker server (installed as ``shmq.server``): ``shmq serve``.

``supervisor`` owns the instance's shared memory, starts and restarts the
workers and the journal process, and runs the lease reaper; each ``worker``
serves clients on an asyncio event loop over a SO_REUSEPORT socket, speaking
the wire protocol of ``shmq.protocol.codec`` (layers: ``core``'s docstring).  The server
knows no shared-memory offsets and touches no private attribute of a ``shmq``
object: it calls ``shmq.core.serverqueue`` (queues that never block, durable marks
as values) and ``shmq.core.durability`` (the journal writer's side of the marks).
"""
