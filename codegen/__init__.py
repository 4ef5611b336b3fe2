"""Fused groups -> Triton source, cached on disk and loaded as modules."""
