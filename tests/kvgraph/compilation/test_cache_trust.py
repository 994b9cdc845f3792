"""Loading a compiled artifact runs code: kvgraph refuses a cache dir, or anything in it, that
another user owns or can write, or that is reached through a symbolic link, saying why and how
to fix it; what kvgraph itself creates is private."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

import kvgraph
from kvgraph.compilation.cache import CompileCache
from kvgraph.compilation.cache_key import digest
from kvgraph.errors import ConfigError

KEY = digest("trust-test-key")
NOBODY = 65534

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def write_bytes(payload: bytes):
    return lambda path: Path(path).write_bytes(payload)


def read_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


def give_away(path: Path) -> None:
    """Make another user own `path` (only root can)."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, NOBODY, NOBODY, follow_symlinks=False)


def refusal(call, *args) -> str:
    with pytest.raises(ConfigError) as info:
        call(*args)
    assert info.value.field == "cache_dir"
    return str(info.value)


# --- the cache dir -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode, who", [(0o777, "other users"), (0o1777, "other users"),
                                       (0o770, "its group"), (0o757, "other users")])
def test_cache_dir_writable_by_others_refused(tmp_path, mode, who):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(mode)
    for message in (refusal(lambda: kvgraph.CompilationConfig(cache_dir=str(root))),
                    refusal(CompileCache.open, root, KEY)):
        assert str(root) in message and who in message
        assert f"chmod go-w {root}" in message and "KVGRAPH_CACHE_DIR" in message
        assert "runs its code" in message  # why


def test_cache_dir_from_env_names_the_variable(tmp_path):
    tmp_path.chmod(0o777)
    with pytest.raises(ConfigError, match=r"other users.*\(from KVGRAPH_CACHE_DIR\)$"):
        kvgraph.CompilationConfig.from_env({"KVGRAPH_CACHE_DIR": str(tmp_path)})


def test_cache_dir_of_another_user_refused(tmp_path):
    give_away(tmp_path)
    message = refusal(kvgraph.CompilationConfig.from_options, {"cache_dir": str(tmp_path)})
    assert f"belongs to uid {NOBODY}" in message and "a cache dir of your own" in message
    assert "belongs to uid" in refusal(CompileCache.open, tmp_path, KEY)


def test_cache_dir_may_be_a_link_to_a_private_dir(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    kvgraph.CompilationConfig(cache_dir=str(link))
    cache = CompileCache.open(link, KEY)
    cache.save("piece", write_bytes(b"through a link"))
    assert cache.load("piece", read_bytes) == b"through a link"
    assert (target / cache.directory.name / "piece.bin").is_file()


def test_backend_refuses_an_untrusted_cache_dir_before_compiling(tmp_path):
    tmp_path.chmod(0o777)
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="kvgraph",
                             options={"cache_dir": str(tmp_path)})
    with pytest.raises(BackendCompilerFailed) as info:
        compiled(torch.ones(2, 2))
    assert isinstance(info.value.inner_exception, ConfigError)
    assert "chmod go-w" in str(info.value.inner_exception)
    assert list(tmp_path.iterdir()) == []  # nothing written there


# --- what lies in it ---------------------------------------------------------------------------


def test_artifact_linked_to_a_file_elsewhere_refused_unread(tmp_path):
    elsewhere = CompileCache.open(tmp_path / "elsewhere", KEY)
    elsewhere.save("piece", write_bytes(b"code from somewhere else"))
    cache = CompileCache.open(tmp_path / "cache", KEY)
    cache.path("piece").symlink_to(elsewhere.path("piece"))
    loaded = []
    message = refusal(cache.load, "piece", lambda p: loaded.append(p))
    assert loaded == []
    assert "symbolic link" in message and str(elsewhere.path("piece")) in message
    assert "Remove the link" in message
    assert cache.path("piece").is_symlink()  # not deleted behind the user's back


@pytest.mark.parametrize("which", ["directory", "inductor_directory"])
def test_directory_linked_out_of_the_cache_refused(tmp_path, which):
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    getattr(CompileCache(root, KEY), which).symlink_to(outside)
    assert "symbolic link" in refusal(CompileCache.open, root, KEY)


def test_artifact_dir_writable_by_others_refused(tmp_path):
    CompileCache.open(tmp_path, KEY).directory.chmod(0o777)
    assert "chmod go-w" in refusal(CompileCache.open, tmp_path, KEY)


def test_artifact_writable_by_group_refused(tmp_path):
    cache = CompileCache.open(tmp_path, KEY)
    cache.save("piece", write_bytes(b"x"))
    cache.path("piece").chmod(0o660)
    assert "its group" in refusal(cache.load, "piece", read_bytes)


def test_artifact_of_another_user_refused(tmp_path):
    cache = CompileCache.open(tmp_path, KEY)
    cache.save("piece", write_bytes(b"x"))
    give_away(cache.path("piece"))
    assert f"belongs to uid {NOBODY}" in refusal(cache.load, "piece", read_bytes)


def test_what_kvgraph_creates_is_private_whatever_the_umask(tmp_path):
    previous = os.umask(0)
    try:
        cache = CompileCache.open(tmp_path / "new" / "cache", KEY)
        cache.save("piece", write_bytes(b"x"))
    finally:
        os.umask(previous)
    modes = {path: stat.S_IMODE(path.stat().st_mode) for path in
             (cache.root, cache.directory, cache.inductor_directory, cache.path("piece"))}
    assert modes == {cache.root: 0o700, cache.directory: 0o700,
                     cache.inductor_directory: 0o700, cache.path("piece"): 0o600}
    assert CompileCache.open(cache.root, KEY).load("piece", read_bytes) == b"x"


# --- inductor's tree: its files are code too ---------------------------------------------------


def inductor_tree(root: Path) -> Path:
    """A cache whose inductor dir holds a few levels of (private) entries; the deepest dir."""
    cache = CompileCache.open(root, KEY)
    deep = cache.inductor_directory / "fxgraph" / "ab" / "entry"
    deep.mkdir(mode=0o700, parents=True)
    (deep / "payload").write_bytes(b"x")
    return deep


def test_a_link_deep_in_the_inductor_tree_refused_unfollowed(tmp_path):
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o1777)
    deep = inductor_tree(tmp_path / "cache")
    (deep / "kernel.py").symlink_to(world / "kernel.py")
    message = refusal(CompileCache.open, tmp_path / "cache", KEY)
    assert f"inductor cache entry {deep / 'kernel.py'}" in message
    assert "symbolic link" in message and "Remove the link" in message
    assert (deep / "kernel.py").is_symlink() and list(world.iterdir()) == []


def test_a_dir_in_the_inductor_tree_writable_by_others_refused(tmp_path):
    deep = inductor_tree(tmp_path)
    deep.chmod(0o777)
    message = refusal(CompileCache.open, tmp_path, KEY)
    assert str(deep) in message and f"chmod go-w {deep}" in message


def test_a_file_in_the_inductor_tree_of_another_user_refused(tmp_path):
    deep = inductor_tree(tmp_path)
    give_away(deep / "payload")
    assert f"belongs to uid {NOBODY}" in refusal(CompileCache.open, tmp_path, KEY)
