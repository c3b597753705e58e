"""The broker server (installed as ``shmq.server``).

``shmq serve`` will run a supervisor and a pool of SO_REUSEPORT workers here
(issue 3).  Until then this package holds the co-located demo that
``make run`` starts: it creates the default instance and shows a producer
and a consumer process exchanging messages through shared memory.
"""
