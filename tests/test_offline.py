"""Nothing leaves the machine: no name lookup, connect or send to another host while glmcore lists
backends or runs a model on openvino_amx, and OpenVINO's telemetry writes no client id (issue 14)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GUARD = Path(__file__).resolve().parent / "netguard"


def _run(tmp_path, *argv):
    log = tmp_path / "net.log"
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TF_BUILD", "JENKINS_URL")}   # those mute
    env.update(HOME=str(home), GLMCORE_NETLOG=str(log), GLMCORE_CACHE=str(tmp_path / "cache"),   # telemetry
               PYTHONPATH=os.pathsep.join([str(GUARD), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "glmcore.cli", *argv], env=env, capture_output=True, text=True,
                       timeout=600)
    return r, (log.read_text() if log.exists() else ""), home


def test_the_guard_sees_a_lookup(tmp_path):
    """The audit hook works: a lookup of a remote name is recorded (and then fails offline, as it may)."""
    log = tmp_path / "net.log"
    env = {**os.environ, "GLMCORE_NETLOG": str(log), "PYTHONPATH": str(GUARD)}
    subprocess.run([sys.executable, "-c", "import socket\ntry: socket.getaddrinfo('example.com', 443)\n"
                    "except OSError: pass"], env=env, timeout=60)
    assert "example.com" in log.read_text()


def test_backends_and_an_openvino_run_stay_offline(tmp_path):
    pytest.importorskip("openvino")
    r, log, home = _run(tmp_path, "backends")
    assert r.returncode == 0, r.stderr
    assert log == "" and not (home / "intel").exists(), log
    r, log, home = _run(tmp_path, "run", "--backend", "openvino_amx", "--prompt", "hi", "--max-new-tokens", "2",
                        "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert log == "" and not (home / "intel").exists(), log


NNCF_COMPRESSION = """
import numpy as np
import glmcore  # noqa: F401  (as the benchmark's NNCF worker does: first)
import nncf
import openvino as ov
from openvino import opset13 as ops
x = ops.parameter([1, 64], np.float32, name="x")
w = ops.convert(ops.constant(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float16)), np.float32)
model = ov.Model([ops.matmul(x, w, False, True)], [x])
out = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=32, ratio=1.0, all_layers=True)
assert any(op.get_output_element_type(0).get_type_name() == "i4" for op in out.get_ops())
"""


def test_nncf_weight_compression_stays_offline(tmp_path):
    """NNCF (the OpenVINO benchmark's row for OpenVINO's own compressed form) reports usage through
    openvino_telemetry, consenting when no consent file exists; after glmcore's import it sends nothing."""
    pytest.importorskip("nncf")
    log, home = tmp_path / "net.log", tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TF_BUILD", "JENKINS_URL")}
    env.update(HOME=str(home), GLMCORE_NETLOG=str(log),
               PYTHONPATH=os.pathsep.join([str(GUARD), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", NNCF_COMPRESSION], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (log.read_text() if log.exists() else "") == "" and not (home / "intel").exists()
