"""Example models and demos built on kvgraph."""
