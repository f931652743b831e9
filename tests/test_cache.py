import os

import pytest

from glmcore.cache import build_once, cache_root


def done(p):
    return (p / "done").is_file()


def test_builds_once_then_reuses(tmp_path):
    calls = []

    def build(d):
        calls.append(d)
        (d / "done").write_text("x")

    assert build_once(tmp_path / "r", build, done) == tmp_path / "r"
    build_once(tmp_path / "r", build, done)
    assert len(calls) == 1 and done(tmp_path / "r")
    assert [p.name for p in tmp_path.iterdir()] == ["r"]          # no temporary left behind


def test_stale_result_is_replaced_and_failed_build_leaves_nothing(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "half").write_text("interrupted")
    build_once(tmp_path / "r", lambda d: (d / "done").write_text("x"), done)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["done"]

    def boom(d):
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError):
        build_once(tmp_path / "s", boom, done)
    assert not (tmp_path / "s").exists() and [p.name for p in tmp_path.iterdir()] == ["r"]


def test_concurrent_winner_is_kept(tmp_path):
    def build_while_someone_else_finishes(d):
        (d / "done").write_text("mine")
        (tmp_path / "r").mkdir()
        (tmp_path / "r" / "done").write_text("theirs")

    build_once(tmp_path / "r", build_while_someone_else_finishes, done)
    assert (tmp_path / "r" / "done").read_text() == "theirs"


def test_cache_root_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("GLMCORE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "glmcore"
    assert os.fspath(cache_root()).endswith("glmcore")
