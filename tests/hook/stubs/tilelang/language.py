"""Test-only stand-in for tilelang.language (see the package docstring): only kernel bodies use it."""
