"""hasten's version, in a module of its own: what reads it (``hasten.__version__``, the checkpoint
manifest) imports it from here, never the package above it."""

__version__ = "0.1.0"
