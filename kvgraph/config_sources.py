"""Settings given as strings: `torch.compile(options=...)`, `KVGRAPH_*` variables, flags.

Strings are parsed here and nowhere else; any other value goes to the config's constructor as it
came, and the constructor checks types and values. Every error names the setting and, for a
variable or a flag, which one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from kvgraph.errors import ConfigError

ENV_PREFIX = "KVGRAPH_"
# DESIGN.md names the dump variable without the `_PATH` suffix.
ENV_ALIASES = {"debug_dump_path": "KVGRAPH_DEBUG_DUMP"}

# A setting as given: its value, and the variable or flag it came from (None for an option).
Given = Mapping[str, tuple[Any, str | None]]


def env_name(field: str) -> str:
    return ENV_ALIASES.get(field, ENV_PREFIX + field.upper())


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def _parse_names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in _parse_names(text))
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


_PARSERS: dict[str, Callable[[str], Any]] = {
    "max_num_tokens": int,
    "capture_sizes": lambda t: None if t.strip().lower() in ("", "auto") else _parse_sizes(t),
    "compile_sizes": _parse_sizes,
    "num_speculative_tokens": int,
    "splitting_ops": _parse_names,
    "passes": _parse_names,
    "use_compile_cache": _parse_bool,
    "cache_dir": lambda t: t if t.strip() else None,
    "debug_dump_path": lambda t: t or None,
    "check_guards": _parse_bool,
    "check_graph_inputs": _parse_bool,
    "check_rank_agreement": _parse_bool,
    "verify": _parse_bool,
    "verify_every": int,
    "verify_tolerance": lambda t: float(t) if t.strip() else None,
}
# Where None (an option's None, or a blank string) means "the default", not a value.
NONE_MEANS_DEFAULT = ("cache_dir",)


def _from(source: str | None) -> str:
    return f" (from {source})" if source else ""


def parse(field: str, value: Any, source: str | None = None) -> Any:
    """`value` for `field`: a string parsed, anything else as it came."""
    if not isinstance(value, str) or field not in _PARSERS:
        return value
    try:
        return _PARSERS[field](value)
    except ValueError as error:
        raise ConfigError(field, f"bad value for {field}{_from(source)}: {error}") from None


def env_settings(fields: list[str], environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The `KVGRAPH_<FIELD>` variables that are set, as {field: (text, variable)}."""
    return {field: (environ[env_name(field)], env_name(field))
            for field in fields if env_name(field) in environ}


def build(cls: type, given: Given) -> Any:
    """`cls(**values)` from {field: (value, source)}; a ConfigError names the value's source."""
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(unknown[0],
                          f"unknown kvgraph option(s) {unknown}; valid: {sorted(known)}")
    values = {field: parse(field, value, source) for field, (value, source) in given.items()}
    try:
        return cls(**{field: value for field, value in values.items()
                      if value is not None or field not in NONE_MEANS_DEFAULT})
    except ConfigError as error:
        source = given.get(error.field, (None, None))[1]
        if source is None:
            raise
        raise ConfigError(error.field, f"{error}{_from(source)}") from None
