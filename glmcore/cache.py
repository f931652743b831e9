"""The cache directory, the one way results are written into it, and what a converted model records.

Conversion results (synthetic checkpoints, OpenVINO IR, ONNX parts, packed int4) are expensive and
may be built by two processes at once, so each is built in a temporary sibling directory and renamed
into place: a reader never sees half a result, and a concurrent build of the same thing is harmless.

Every result is sealed: `glmcore-entry.json` lists its files with their sizes (and the SHA-256 of
the small ones, e.g. an IR's .xml or a packed model's meta.json) and the identity of the checkpoint
it was converted from. A cache entry that no longer matches its seal (truncated, edited) is rebuilt;
a converted directory given by the user (`--opt ir=`, `--opt packed=`) that does not match, or that
was converted from other weights, is refused before any runtime reads it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import BackendError, GlmcoreError

ENTRY = "glmcore-entry.json"
HASHED_BELOW = 16 << 20        # files up to this size are hashed when sealed and checked on every use
STALE_BUILD_S = 3600           # a temporary build directory older than this is a leftover of a killed build
BUILD_SUFFIX = ".part"         # build_once's temporary directories: ".NAME-XXXXXXXX.part"


def cache_root() -> Path:
    if os.environ.get("GLMCORE_CACHE"):
        return Path(os.environ["GLMCORE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "glmcore"


SMALL_JSON_LIMIT = 1 << 20     # a remembered measurement or memo; anything bigger was not written by glmcore


def read_json(name: str):
    """A small JSON file at the cache root (a measurement or memo glmcore remembered), or None: missing,
    unreadable, over SMALL_JSON_LIMIT bytes, or not JSON -- the caller measures again."""
    from .files import read_bounded
    try:
        return json.loads(read_bounded(cache_root() / name, SMALL_JSON_LIMIT, "cache file", "it is made again",
                                       error=ValueError))
    except (OSError, ValueError):
        return None


def write_json(name: str, data) -> None:
    """Write a small JSON file at the cache root whole or not at all (two writers at once: the last one wins).
    Raises OSError where the cache cannot be written."""
    path = cache_root() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def build_once(final: Path, build: Callable[[Path], object], complete: Callable[[Path], bool],
               source: str | None = None) -> Path:
    """Make directory `final` by build(tmp) unless it is already complete and intact. A stale `final`
    (incomplete, or not matching its seal) is replaced."""
    final = Path(final)
    if complete(final) and intact(final):
        os.utime(final / ENTRY)       # last use, for `glmcore cache prune`
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-", suffix=BUILD_SUFFIX))
    try:
        build(tmp)
        seal(tmp, source)
        if final.exists() and not (complete(final) and intact(final)):
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (complete(final) and intact(final)):   # only a concurrent build of the same result may win
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---------------------------------------------------------------- seals

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def seal(d: Path, source: str | None = None) -> None:
    """Record d's files (size, and hash when small) and the source checkpoint's identity."""
    d = Path(d)
    files = {}
    for f in sorted(p for p in d.rglob("*") if p.is_file() and p.name != ENTRY):
        size = f.stat().st_size
        files[f.relative_to(d).as_posix()] = {"size": size, **({"sha256": _sha256(f)} if size <= HASHED_BELOW else {})}
    (d / ENTRY).write_text(json.dumps({"source": source, "created": time.time(), "files": files}, indent=1) + "\n")


def _problem(d: Path) -> str:
    """Why directory d does not match its seal, or ""."""
    try:
        entry = json.loads((d / ENTRY).read_text(encoding="utf-8"))
        files = entry["files"]
        assert isinstance(files, dict)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AssertionError, RecursionError):
        return f"no valid {ENTRY} (converted by an older glmcore, or not by glmcore)"
    for rel, info in files.items():
        f = d / rel
        if not isinstance(info, dict) or ".." in Path(rel).parts or Path(rel).is_absolute():
            return f"{ENTRY} is corrupt"
        if not f.is_file() or f.stat().st_size != info.get("size"):
            return f"{rel} is missing or has the wrong size (truncated?)"
        if "sha256" in info and _sha256(f) != info["sha256"]:
            return f"{rel} was modified after conversion"
    return ""


def intact(d: Path) -> bool:
    return (Path(d) / ENTRY).is_file() and not _problem(Path(d))


def source_of(d: Path) -> str | None:
    try:
        return json.loads((Path(d) / ENTRY).read_text(encoding="utf-8")).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def check_converted(d: Path, weights, what: str) -> Path:
    """A converted model directory given by the user: intact, and converted from these weights."""
    d = Path(d)
    if not d.is_dir():
        raise BackendError(f"{d}: no such directory; pass the --out directory of `glmcore convert` ({what})")
    problem = _problem(d)
    if problem:
        raise BackendError(f"{d}: not a usable {what}: {problem}; convert the model again")
    expected = weights.fingerprint() if hasattr(weights, "fingerprint") else None
    if expected is not None and source_of(d) != expected:
        raise BackendError(f"{d}: this {what} was converted from a different model than --model (other weights "
                           "or config); convert this model again, or pass the --model it was converted from")
    return d


# ---------------------------------------------------------------- output directories

def new_output_dir(path, flag: str = "--out") -> Path:
    """`path` as the place of a new result: absent or an empty directory. A user's files are never
    overwritten or deleted."""
    p = Path(path)
    if p.is_symlink():
        # results are renamed into place, which a symlink would not survive: write into its target instead
        target = Path(os.path.realpath(p))
        if not target.exists():
            raise GlmcoreError(f"{flag} {p} is a symlink to {target}, which does not exist; create that directory "
                               "or give a new or empty directory")
        p = target
    if p.resolve() == cache_root().resolve():
        raise GlmcoreError(f"{flag} {p} is glmcore's cache directory itself, where `glmcore cache` would not see "
                           f"it; give a directory of its own, e.g. {p / 'my-model'}")
    if p.exists() and not p.is_dir():
        raise GlmcoreError(f"{flag} {p} is a file; give a new or empty directory")
    if p.is_dir() and any(p.iterdir()):
        raise GlmcoreError(f"{flag} {p} is not empty; give a new or empty directory (nothing in it was changed)")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GlmcoreError(f"{flag} {p}: cannot create it ({e.strerror}); choose another directory") from None
    return p


# ---------------------------------------------------------------- `glmcore cache`

@dataclass
class CacheEntry:
    name: str            # path relative to the cache root
    path: Path
    size: int            # bytes
    last_used: float     # epoch seconds
    state: str           # "ok", "damaged: why", "incomplete build", "not sealed"

    @property
    def ours(self) -> bool:
        """Whether glmcore wrote it (sealed, or one of its own build leftovers): only these are ever removed;
        a directory without a seal may be the user's own files under GLMCORE_CACHE."""
        return self.state != "not sealed"


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def entries(root: Path | None = None) -> list[CacheEntry]:
    """Every result in the cache (a sealed directory, a leftover temporary build, or a directory of files
    from an older glmcore), without descending into results."""
    root = Path(root or cache_root())
    out: list[CacheEntry] = []

    def visit(d: Path, depth: int) -> None:
        for p in sorted(d.iterdir()) if d.is_dir() else []:
            if not p.is_dir() or p.is_symlink():
                continue
            name = p.relative_to(root).as_posix()
            if (p / ENTRY).is_file():
                problem = _problem(p)
                out.append(CacheEntry(name, p, _du(p), (p / ENTRY).stat().st_mtime,
                                      f"damaged: {problem}" if problem else "ok"))
            elif p.name.startswith(".") and p.name.endswith(BUILD_SUFFIX):
                out.append(CacheEntry(name, p, _du(p), p.stat().st_mtime, "incomplete build"))
            elif p.name.startswith("."):
                continue                  # hidden and not ours (.git, .config): not an entry, never visited
            elif any(f.is_file() for f in p.iterdir()) or depth >= 3:
                out.append(CacheEntry(name, p, _du(p), p.stat().st_mtime, "not sealed"))
            else:
                visit(p, depth + 1)

    visit(root, 0)
    return out


def remove(entry: CacheEntry) -> None:
    if not entry.ours:
        raise GlmcoreError(f"cache: {entry.name} has no glmcore seal, so glmcore did not write it and will not "
                           f"delete it; remove {entry.path} yourself if it is yours to delete")
    shutil.rmtree(entry.path)


def prune(older_than_days: float, root: Path | None = None) -> list[CacheEntry]:
    """Remove what is not worth keeping: damaged entries (they would be rebuilt anyway), leftovers of
    killed builds, and anything unused for older_than_days -- of what glmcore wrote only (CacheEntry.ours).
    Returns what was removed."""
    now, gone = time.time(), []
    for e in entries(root):
        if not e.ours:
            continue
        unused = now - e.last_used
        if e.state.startswith("damaged") or (e.state == "incomplete build" and unused > STALE_BUILD_S) \
                or unused > older_than_days * 86400:
            remove(e)
            gone.append(e)
    return gone
