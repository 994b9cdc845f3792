"""GraphMode: which parts of a forward run as captured graphs, and what each mode implies.

Its own module, below the config and its flags, which both name the modes; `kvgraph.config`
re-exports it, where most code imports it from.
"""

from __future__ import annotations

import enum

from kvgraph.errors import ConfigError


class GraphMode(enum.Enum):
    """Which parts of a forward run as captured graphs (see DESIGN.md, contract 4)."""

    EAGER = "eager"
    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @property
    def has_full_graphs(self) -> bool:
        """Whether some steps run as one graph of the whole forward, attention included."""
        return self in (GraphMode.FULL, GraphMode.FULL_DECODE_ONLY, GraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise_graphs(self) -> bool:
        """Whether some steps run as graphs of the pieces between attention ops."""
        return self in (GraphMode.PIECEWISE, GraphMode.FULL_AND_PIECEWISE)

    @property
    def has_graphs(self) -> bool:
        """Whether some steps run as captured graphs (full or piecewise): not eager, not none."""
        return self.has_full_graphs or self.has_piecewise_graphs

    @property
    def compiles(self) -> bool:
        """Whether the forward is compiled at all: every mode but eager."""
        return self is not GraphMode.EAGER

    @property
    def only_full_graphs(self) -> bool:
        """Whether the whole forward is built as one piece, attention included (never split)."""
        return self in (GraphMode.FULL, GraphMode.FULL_DECODE_ONLY)

    @property
    def is_runtime_mode(self) -> bool:
        """Whether one step can run as this mode: none, piecewise or full (not eager, not a mix)."""
        return self in (GraphMode.NONE, GraphMode.PIECEWISE, GraphMode.FULL)

    @classmethod
    def parse(cls, value: GraphMode | str) -> GraphMode:
        if isinstance(value, cls):
            return value
        valid = [m.value for m in cls]
        if not isinstance(value, str):
            raise ConfigError("graph_mode", f"graph_mode: expected a GraphMode or one of {valid}, "
                              f"got {value!r} ({type(value).__name__})")
        try:
            return cls(value.lower())
        except ValueError:
            raise ConfigError("graph_mode",
                              f"unknown graph_mode {value!r}; valid: {valid}") from None
