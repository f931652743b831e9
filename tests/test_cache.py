import os
from pathlib import Path

import pytest

from glmcore.cache import ENTRY, build_once, cache_root, check_converted, seal


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
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["done", ENTRY]

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
        seal(tmp_path / "r")

    build_once(tmp_path / "r", build_while_someone_else_finishes, done)
    assert (tmp_path / "r" / "done").read_text() == "theirs"


def test_cache_root_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("GLMCORE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "glmcore"
    assert os.fspath(cache_root()).endswith("glmcore")


# ------------------------------------------------------------------ seals, damaged entries, provenance

def test_a_truncated_cache_entry_is_rebuilt(tmp_path):
    calls = []

    def build(d):
        calls.append(1)
        (d / "done").write_text("x")
        (d / "weights.bin").write_bytes(b"\1" * 1000)

    r = build_once(tmp_path / "r", build, done)
    (r / "weights.bin").write_bytes(b"\1" * 10)              # truncated after the build
    build_once(tmp_path / "r", build, done)
    assert len(calls) == 2 and (r / "weights.bin").stat().st_size == 1000
    (r / "done").write_text("edited")                        # a small file is hashed: an edit is seen too
    build_once(tmp_path / "r", build, done)
    assert len(calls) == 3


def test_check_converted_refuses_damage_and_other_weights(tmp_path):
    from glmcore.errors import GlmcoreError

    class W:
        def __init__(self, fp):
            self.fp = fp

        def fingerprint(self):
            return self.fp

    d = tmp_path / "conv"
    d.mkdir()
    (d / "meta.json").write_text("{}")
    with pytest.raises(GlmcoreError, match="no valid glmcore-entry.json"):
        check_converted(d, W("a"), "thing")
    seal(d, source="a")
    assert check_converted(d, W("a"), "thing") == d
    with pytest.raises(GlmcoreError, match="converted from a different model"):
        check_converted(d, W("b"), "thing")
    (d / "meta.json").write_text("[]")
    with pytest.raises(GlmcoreError, match="meta.json was modified"):
        check_converted(d, W("a"), "thing")
    with pytest.raises(GlmcoreError, match="no such directory"):
        check_converted(tmp_path / "nope", W("a"), "thing")


def test_fingerprint_is_content_not_path(make_tiny, tmp_path):
    import shutil
    from glmcore.config import ModelConfig
    from glmcore.synth import make_model
    from glmcore.weights import load_weights
    a = make_tiny("chatglm3")
    b = tmp_path / "copy"
    shutil.copytree(a, b)
    cfg = ModelConfig.from_dir(a)
    assert load_weights(a, cfg).fingerprint() == load_weights(b, cfg).fingerprint()
    make_model("chatglm3", "tiny", tmp_path / "other", seed=1)      # same config, other weights
    assert load_weights(tmp_path / "other", cfg).fingerprint() != load_weights(a, cfg).fingerprint()


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads RssFile from /proc (Linux)")
def test_fingerprint_leaves_no_mapped_pages_behind(tmp_path, monkeypatch):
    """The fingerprint reads 16 rows of every tensor of a memory-mapped checkpoint; the pages it touches (and
    those the kernel maps around them) must not stay in the process's RSS: over the thousands of expert tensors
    of an MoE checkpoint that was GBs for as long as a server ran."""
    import numpy as np
    from glmcore.weights import Weights, read_safetensors, write_safetensors
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    write_safetensors(tmp_path / "w.safetensors",
                      {f"t{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(64)})   # 64 MiB

    def mapped_kib() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssFile:"))

    w = Weights(read_safetensors(tmp_path / "w.safetensors"), [tmp_path / "w.safetensors"])
    before = mapped_kib()
    w.fingerprint()
    assert mapped_kib() - before < 4 << 10, mapped_kib() - before     # under 4 MiB of the 64


# ------------------------------------------------------------------ glmcore cache

def _cli(capsys, *argv):
    from glmcore.cli import main
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cache_list_remove_prune(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path))
    for name in ("converted/cpu_int4-aaa", "converted/openvino_amx/x-int8-bbb"):
        build_once(tmp_path / name, lambda d: (d / "done").write_bytes(b"0" * 2**20), done)
    old = tmp_path / "models" / "chatglm3-tiny-seed9"
    build_once(old, lambda d: (d / "done").write_text("x"), done)
    os.utime(old / ENTRY, (0, 0))                                           # last used long ago
    leftover = tmp_path / "converted" / ".cpu_int4-ccc-xyz.part"
    leftover.mkdir()
    (leftover / "weights.bin.part").write_bytes(b"0" * 100)
    os.utime(leftover, (0, 0))
    rc, out, _ = _cli(capsys, "cache", "list")
    assert rc == 0
    for name in ("converted/cpu_int4-aaa", "converted/openvino_amx/x-int8-bbb", "models/chatglm3-tiny-seed9",
                 "converted/.cpu_int4-ccc-xyz.part"):
        assert name in out
    assert "1.0 MiB" in out and "incomplete build" in out and "4 entries" in out
    rc, out, _ = _cli(capsys, "cache", "remove", "converted/cpu_int4-aaa")
    assert rc == 0 and not (tmp_path / "converted/cpu_int4-aaa").exists()
    assert _cli(capsys, "cache", "remove", "nope")[0] == 2
    rc, out, _ = _cli(capsys, "cache", "prune")
    assert rc == 0 and not old.exists() and not leftover.exists()
    assert (tmp_path / "converted/openvino_amx/x-int8-bbb").exists()       # recently used: kept
    rc, out, _ = _cli(capsys, "cache", "prune", "--older-than", "0")
    assert not (tmp_path / "converted/openvino_amx/x-int8-bbb").exists()


def test_fingerprint_is_remembered_until_a_file_changes(tmp_path, monkeypatch):
    """The rows a fingerprint reads are random reads (seconds over an MoE checkpoint on a cold page cache): the
    result is kept in the cache against the files' paths, sizes, times and inodes, and read again once a file
    changes."""
    import numpy as np
    from glmcore.weights import Weights, read_safetensors, write_safetensors
    monkeypatch.setenv("GLMCORE_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "w.safetensors"
    write_safetensors(f, {"t": np.arange(64, dtype=np.float32).reshape(16, 4)})
    first = Weights(read_safetensors(f), [f]).fingerprint()
    assert (tmp_path / "cache" / "fingerprints.json").is_file()
    stat = f.stat()
    data = bytearray(f.read_bytes())
    data[-1] ^= 1                                   # the last row's bytes, same size, same times: remembered
    f.write_bytes(bytes(data))
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert Weights(read_safetensors(f), [f]).fingerprint() == first
    one = read_safetensors(f)                       # another view of the same file: its own fingerprint
    one["u"] = one["t"][:8]
    assert Weights(one, [f]).fingerprint() != first
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))      # touched: read again, and it differs
    assert Weights(read_safetensors(f), [f]).fingerprint() != first
    for garbled in ("{not json", "[1]", '{"x": "' + "a" * (2 << 20) + '"}'):   # not JSON, not a map, over 1 MiB
        (tmp_path / "cache" / "fingerprints.json").write_text(garbled)
        assert Weights(read_safetensors(f), [f]).fingerprint() != first      # read again (the file changed)
        assert (tmp_path / "cache" / "fingerprints.json").stat().st_size < 1 << 20   # and remembered afresh
