"""The TCP clients: a blocking one (``tcp``) and an asyncio one (``aio``), on ``shmq.protocol``."""
