"""The graph runtime: ModelRunner, step plans, dispatch, graph capture, and platforms."""
