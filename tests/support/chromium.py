"""Headless Chromium for the tests of the HTML page: the binary, a screenshot, the DOM as
rendered.

`chromium_binary()` finds it; where there is none the test skips, unless
KVGRAPH_REQUIRE_CHROMIUM=1 (set by .ci/run, which installs Debian's `chromium` package), where
the test fails instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REQUIRE = "KVGRAPH_REQUIRE_CHROMIUM"
_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_SECONDS = 120  # a cold start on two busy cores takes a few seconds; a hang must still end
# No GPU, no sandbox (CI runs as root, where Chromium's sandbox refuses to start), a small
# /dev/shm in containers, no scrollbars in the screenshot.
_FLAGS = ("--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage",
          "--hide-scrollbars", "--no-first-run")


def chromium_binary() -> str:
    """The path of a Chromium (or Chrome) binary; skips the test where there is none, or fails
    it where REQUIRE is set to 1."""
    for name in _NAMES:
        found = shutil.which(name)
        if found:
            return found
    reason = (f"no Chromium binary on PATH (looked for {', '.join(_NAMES)}); "
              "install one with `apt-get install chromium`")
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{REQUIRE}=1, but {reason}")
    pytest.skip(reason)


def screenshot(binary: str, page: Path, png: Path, width: int, height: int) -> Path:
    """A PNG of the top `width` x `height` pixels of `page` as Chromium renders it."""
    _run(binary, page, f"--screenshot={png}", f"--window-size={width},{height}")
    return png


def rendered_dom(binary: str, page: Path) -> str:
    """The DOM of `page` once Chromium has loaded it, serialised as HTML."""
    return _run(binary, page, "--dump-dom")


def _run(binary: str, page: Path, *flags: str) -> str:
    """Chromium's stdout for `page`; its profile a new directory (nothing of the user's read)."""
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run([binary, *_FLAGS, f"--user-data-dir={profile}", *flags,
                                 page.resolve().as_uri()], capture_output=True, text=True,
                                timeout=_SECONDS, cwd=profile)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
