"""llminfer's version (its own module, so that code inside the package can read it without importing
the package's ``__init__`` and everything it loads)."""

__version__ = "0.1.0"
