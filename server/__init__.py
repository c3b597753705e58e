"""The broker server (installed as ``shmq.server``): ``shmq serve``.

``supervisor`` owns the instance's shared memory, starts and restarts the
workers and runs the lease reaper; ``worker`` serves clients on an asyncio
event loop over a SO_REUSEPORT socket, speaking the wire protocol of
``shmq.codec``.  The server knows no shared-memory offsets: it calls the
queue API of ``shmq.shm``.
"""
