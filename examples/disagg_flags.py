"""The disaggregated-prefill proxy's flag types (examples/disagg_proxy.py): one-line mistakes,
server URLs and bounded numbers."""

from __future__ import annotations

import argparse
import urllib.parse
from typing import Any


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line (`disagg_proxy.py: error: ...`) and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def server_url(text: str) -> str:
    """argparse's type for --prefill and --decode: a server's root URL, without /v1."""
    parts = urllib.parse.urlsplit(text)
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not one
    except ValueError:
        parts = parts._replace(netloc="")
    if (parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/")
            or parts.query or parts.fragment):
        raise argparse.ArgumentTypeError(f"expected a server's root URL such as "
                                         f"http://127.0.0.1:8100 (no path), got {text!r}")
    return f"{parts.scheme}://{parts.netloc}"


def number(low: float, high: float, kind: type, what: str):
    """An argparse type: a `kind` number in [low, high]."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= value <= high:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must lie in [{low:g}, {high:g}], got {text}")
        return value

    return parse
