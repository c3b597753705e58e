"""The version of shmq, kept here so that any layer can name it without the facade."""

__version__ = "0.1.0"
