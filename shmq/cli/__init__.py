"""The ``shmq`` command line: the typer app (``app``) and its parts."""
