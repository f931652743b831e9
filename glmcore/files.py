"""Reading files a user names (or that a model directory holds) without trusting them: a size bound read
before anything is parsed, and regular files only where a special file would hang or never end (a FIFO
blocks open() until a writer comes; /dev/zero never reaches EOF)."""
from __future__ import annotations

import stat
from pathlib import Path

from .errors import GlmcoreError


def is_regular(path) -> bool:
    """Whether path is a regular file (after symlinks); never opens it."""
    try:
        return stat.S_ISREG(Path(path).stat().st_mode)
    except (OSError, ValueError):
        return False


def read_bounded(path, limit: int, what: str, fix: str, error=GlmcoreError) -> bytes:
    """At most `limit` bytes of a user-named file (a regular file, pipe or device): more is an error naming
    `what` and `fix`; never a read without end. A FIFO without a writer is refused rather than waited on."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError as e:
        raise error(f"cannot read {what} {str(path)!r}: {e.strerror}; {fix}") from None
    if stat.S_ISDIR(mode):
        raise error(f"{what} {str(path)!r} is a directory; {fix}")
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise error(f"{what} {str(path)!r} is a pipe or socket, not a file; {fix}")
    try:
        with open(p, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise error(f"cannot read {what} {str(path)!r}: {e.strerror}; {fix}") from None
    if len(data) > limit:
        raise error(f"{what} {str(path)!r} is larger than {limit >> 20} MiB; {fix}")
    return data


def read_json_object(path, limit: int, what: str, fix: str, error=GlmcoreError) -> dict:
    """A user-named JSON file that must hold an object, read bounded as read_bounded reads; anything else is one
    line naming `what` and `fix`."""
    import json
    try:
        data = json.loads(read_bounded(path, limit, what, fix, error).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:80]}); {fix}") from None
    if not isinstance(data, dict):
        raise error(f"{path} is not a JSON object; {fix}")
    return data


def decode_text(data: bytes, what: str, fix: str, error=GlmcoreError) -> str:
    """UTF-8 text, or one line naming the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); {fix}") from None


def check_text(text: str, what: str, fix: str = "pass UTF-8 text", error=GlmcoreError) -> str:
    """Text that came through a surrogateescape decoding (argv, stdin): refuse the bytes it could not decode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte {ord(bad) - 0xDC00:#04x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise error(f"{what} is not valid UTF-8 text ({byte} at character {e.start}); {fix}") from None
    return text
