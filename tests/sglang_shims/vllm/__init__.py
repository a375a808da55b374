"""Test-only stand-in package (see tests/sglang_shims/README.md)."""
