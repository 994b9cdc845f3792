"""Attention layers, per-step metadata, and the backends behind kvgraph's ops."""
