"""kvgraph's CPU kernels and what prepares a model for them.

The C++ kernels in `csrc/` (paged attention, the tiled and small-batch linears, thread
binding) are one library, built on first use by `build.py`. Around them: the weight layouts
the linears read (`tile_weights`, `packed_linear`, `small_batch_linear`), weights moved into
huge pages (`huge_pages`) and glibc's malloc kept from returning freed memory
(`malloc_policy`). The attention backend's Python face is `kvgraph.attention.backends.cpu_paged`;
the CPU platform (`kvgraph.runtime.platforms.cpu`) says which of these a model gets.

A layer below `attention/`: nothing here imports the attention, compilation or runtime code.
"""
