"""Canonicalisation rules, one module per theme; prepare.canonicalize runs them to a fixed point."""
