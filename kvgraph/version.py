"""The kvgraph version, one place for the package and the compile-cache key."""

__version__ = "0.1.0"
