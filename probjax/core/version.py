"""probjax's version: in the core room, so that any room (e.g. the cuDNN extension's cache key)
can read it; ``probjax.__version__`` re-exports it and the build reads it from here."""

__version__ = "0.1.0"
