"""The names of kvgraph's attention ops: a leaf that config and passes can import for free."""

# Every op a graph must be split at; passes match these names (packet and overloads).
ATTENTION_OPS = (
    "kvgraph::unified_attention",
    "kvgraph::unified_mla_attention",
    "kvgraph::encoder_attention",
)
