"""Attention backends whose kernels cannot be recorded into a graph at one batch size, for tests
of failed captures (as a kernel with a workspace too large for the graph pool).

Both are torch_native otherwise, and are registered on import: CannotCaptureFourTokens fails
every capture of FAILING_SIZE tokens, CannotCaptureFourTokensInAFullGraph only a full graph's.
"""

from kvgraph import GraphMode
from kvgraph.attention.backends import register_attention_backend
from kvgraph.attention.backends.torch_native import TorchNativeBackend
from kvgraph.forward_context import get_forward_context

FAILING_SIZE = 4


class CannotCaptureFourTokens(TorchNativeBackend):
    name = "test_cannot_capture_four"

    def forward(self, query, *args, **kwargs):
        graphs = get_forward_context().graphs
        if graphs is not None and graphs.capturing and query.shape[0] == FAILING_SIZE:
            raise RuntimeError("out of memory while recording the graph (test backend)")
        return super().forward(query, *args, **kwargs)


class CannotCaptureFourTokensInAFullGraph(TorchNativeBackend):
    name = "test_cannot_capture_four_in_full"

    def forward(self, query, *args, **kwargs):
        context = get_forward_context()
        if (context.graphs is not None and context.graphs.capturing
                and context.runtime_mode is GraphMode.FULL and query.shape[0] == FAILING_SIZE):
            raise RuntimeError("out of memory while recording the graph (test backend)")
        return super().forward(query, *args, **kwargs)


register_attention_backend(CannotCaptureFourTokens)
register_attention_backend(CannotCaptureFourTokensInAFullGraph)
