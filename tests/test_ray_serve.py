"""`glmcore serve --replicas 2` on a local Ray instance: concurrent OpenAI clients, a replica killed and
restarted while the endpoint keeps answering, every Ray server on the loopback interface, and no Ray
process left after the command exits."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason='Ray Serve is the glmcore[ray] extra: pip install "glmcore[ray]"')
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the process checks read Linux /proc")

START_S = 600        # Ray, its Serve controller and proxy, two replicas importing torch: minutes on 2 busy cores


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _descendants(pid: int) -> set[int]:
    kids, out, todo = _children(), set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _replicas(pid: int) -> set[int]:
    return {p for p in _descendants(pid) if _cmdline(p).startswith("ray::ServeReplica")}


def _listening_outside_loopback(pids: set[int]) -> list[str]:
    """Listening TCP sockets of these processes on any address but 127.0.0.1 / ::1 / ::ffff:127.0.0.1."""
    listening = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":                                   # LISTEN
                listening[f[9]] = f[1]
    loopback = ("0100007F:", "00000000000000000000000001000000:", "0000000000000000FFFF00000100007F:")
    bad = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
            if inode in listening and not listening[inode].startswith(loopback):
                bad.append(f"{_cmdline(pid)[:40]} (pid {pid}) listens on {listening[inode]}")
    return bad


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(client, i: int) -> str:
    model = client.models.list().data[0].id          # the served id: the built-in model's directory name
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "你好"}],
                                       max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length"), r
    return r.choices[0].message.content


def test_two_replicas_answer_survive_a_killed_replica_and_leave_nothing(tmp_path):
    port = _free_port()
    log = tmp_path / "serve.err"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "glmcore.cli", "serve", "--replicas", "2", "--backend", "torch",
                                 "--port", str(port), "--slots", "2", "--threads", "1"],
                                stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + START_S
        while "glmcore serve: http" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=6)
        with ThreadPoolExecutor(4) as pool:                   # concurrent clients, one greedy answer
            answers = list(pool.map(lambda i: _ask(client, i), range(6)))
        assert len(set(answers)) == 1 and answers[0]
        before = _replicas(proc.pid)
        assert len(before) == 2
        seen |= _descendants(proc.pid)
        assert _listening_outside_loopback(seen) == []

        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + START_S
        while True:                                           # the endpoint answers while Ray restarts it
            assert _ask(client, 0) == answers[0]
            now = _replicas(proc.pid)
            seen |= _descendants(proc.pid)
            if len(now) == 2 and victim not in now:
                break
            assert time.monotonic() < deadline, f"no replacement replica: {now}"
            time.sleep(2)
        assert _ask(client, 1) == answers[0]
    finally:
        seen |= _descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(180)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, log.read_text(errors="replace")[-3000:]
    assert "glmcore serve: stopped" in log.read_text(errors="replace")
    deadline = time.monotonic() + 60
    while (left := [p for p in seen if Path(f"/proc/{p}").exists() and _cmdline(p)]) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == [], [f"{p}: {_cmdline(p)[:80]}" for p in left]


def test_replicas_option_errors_are_one_line(capsys):
    from glmcore.cli import main
    assert main(["serve", "--replicas", "0", "--backend", "torch"]) == 2
    assert "invalid --replicas 0" in capsys.readouterr().err
