"""The package version, in a module of its own so that any module can read it without importing
the package (hub cards name it)."""

__version__ = "0.1.0"
