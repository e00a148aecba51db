"""The package version, importable from every stage without importing the package root."""

__version__ = "0.1.0"
