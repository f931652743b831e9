"""The server against web pages and loose input (issue 41, items 3, 7 and 11): JSON bodies only (415), the Host
header checked (421, --allowed-hosts), CORS off unless --cors-origins, an empty API key refused, HEAD answered,
"off" values of unsupported fields taken only as their own type, duplicate tool names refused."""
from __future__ import annotations

import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need the dev extra (httpx)")
pytest.importorskip("uvicorn", reason='the server needs its extra: pip install "glmcore[server]"')

from glmcore.backend import LoadOptions  # noqa: E402
from glmcore.errors import GlmcoreError  # noqa: E402
from glmcore.model import load_model  # noqa: E402
from glmcore.server import ServeOptions  # noqa: E402
from glmcore.server.app import create_app  # noqa: E402
from test_server import serving  # noqa: E402

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def model(make_tiny):
    m = load_model(make_tiny("glm4"), "torch", LoadOptions(threads=1), slots=2)
    yield m
    m.close()


@pytest.fixture
def own(make_tiny):
    """A model for a test that serves it itself (serving() stops its scheduler at the end)."""
    m = load_model(make_tiny("glm4"), "torch", LoadOptions(threads=1), slots=1)
    yield m
    m.close()


@pytest.fixture(scope="module")
def url(model):
    with serving(model) as u:
        yield u


def metric(url, name, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   "text/plain; charset=utf-8"])
def test_only_json_bodies_are_taken(url, ctype):
    """What a browser sends cross-origin without a preflight (a CORS simple request) never runs a generation."""
    import json
    before = metric(url, "glmcore_requests_total", endpoint="chat", status="415")
    headers = {"content-type": ctype} if ctype else {}
    r = httpx.post(f"{url}/v1/chat/completions", content=json.dumps(BODY).encode(), headers=headers, timeout=30)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    assert metric(url, "glmcore_requests_total", endpoint="chat", status="415") == before + 1
    r = httpx.post(f"{url}/v1/completions", content=b'{"model": "tiny", "prompt": "x"}', headers=headers, timeout=30)
    assert r.status_code == 415
    r = httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=60)       # application/json
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host,status", [
    ("evil.example", 421), ("evil.example:80", 421), ("127.0.0.1.evil.example", 421), ("", 421),
    ("localhost", 200), ("LOCALHOST:1234", 200), ("127.0.0.1", 200), ("[::1]:8000", 200), ("app.localhost", 200),
])
def test_the_host_header_must_name_this_server(url, host, status):
    """DNS rebinding: a page whose own name now points here sends that name as Host, and is refused."""
    r = httpx.get(f"{url}/health", headers={"host": host})
    assert r.status_code == status, r.text
    if status == 421:
        err = r.json()["error"]
        assert err["code"] == "misdirected_request" and "--allowed-hosts" in err["message"]
        r = httpx.post(f"{url}/v1/chat/completions", json=BODY, headers={"host": host}, timeout=30)
        assert r.status_code == 421


def test_allowed_hosts_and_the_wildcard_binding(own):
    assert ServeOptions(allowed_hosts=("my.box",)).hosts("127.0.0.1") == ["localhost", "127.0.0.1", "::1",
                                                                          "127.0.0.1", "my.box"]
    assert ServeOptions().hosts("0.0.0.0") == ["*"] and "*" not in ServeOptions(allowed_hosts=("a",)).hosts("0.0.0.0")
    with serving(own, allowed_hosts=["localhost", "127.0.0.1", "my.box"]) as u:
        assert httpx.get(f"{u}/health", headers={"host": "my.box:8000"}).status_code == 200
        assert httpx.get(f"{u}/health", headers={"host": "other.box"}).status_code == 421
    with serving(own, allowed_hosts=["*"]) as u:
        assert httpx.get(f"{u}/health", headers={"host": "other.box"}).status_code == 200


def test_cors_is_off_by_default_and_opt_in(url, own):
    origin = {"origin": "http://localhost:8899"}
    preflight = {**origin, "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type"}
    r = httpx.options(f"{url}/v1/chat/completions", headers=preflight)
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    r = httpx.post(f"{url}/v1/chat/completions", json=BODY, headers=origin, timeout=60)
    assert "access-control-allow-origin" not in r.headers
    with serving(own, cors_origins=["http://localhost:8899"]) as u:
        r = httpx.options(f"{u}/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:8899"
        r = httpx.options(f"{u}/v1/chat/completions", headers={**preflight, "origin": "http://evil.example"})
        assert r.headers.get("access-control-allow-origin") != "http://evil.example"


def test_head_is_answered_for_the_page_and_health(url):
    for path in ("/", "/health"):
        r = httpx.head(f"{url}{path}")
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused(model, key):
    with pytest.raises(GlmcoreError, match="API key is empty"):
        create_app(model, "tiny", api_key=key)
    with pytest.raises(GlmcoreError, match="--api-key is empty"):
        ServeOptions(api_key=key).check()


def test_glmcore_serve_refuses_an_empty_api_key_before_loading(tmp_path):
    import os
    for args, env in ((["--api-key", ""], {}), ([], {"GLMCORE_API_KEY": ""})):
        r = subprocess.run([sys.executable, "-m", "glmcore.cli", "serve", "--port", "0", *args],
                           capture_output=True, text=True, timeout=60, env={**os.environ, **env})
        assert r.returncode == 2 and r.stderr.startswith("error: ") and "empty" in r.stderr, r.stderr[-300:]
        assert r.stderr.count("\n") == 1


@pytest.mark.parametrize("cors", ["localhost:3000", "http://x/path", "javascript:alert(1)"])
def test_cors_origins_are_checked(cors):
    with pytest.raises(GlmcoreError, match="invalid --cors-origins"):
        ServeOptions(cors_origins=(cors,)).check()


@pytest.mark.parametrize("field,value", [("logprobs", 0), ("logprobs", 0.0), ("logprobs", {}), ("top_logprobs", {}),
                                         ("top_logprobs", 3), ("logit_bias", {"1": "5"}), ("logit_bias", []),
                                         ("n", 2.0), ("n", True), ("presence_penalty", True),
                                         ("presence_penalty", "0.5")])
def test_off_values_only_of_their_own_type(url, field, value):
    r = httpx.post(f"{url}/v1/chat/completions", json={**BODY, field: value}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == field, r.text


@pytest.mark.parametrize("field,value", [("logprobs", False), ("top_logprobs", None), ("logit_bias", {}), ("n", 1),
                                         ("presence_penalty", 0), ("presence_penalty", 0.0), ("logprobs", None)])
def test_off_values_are_still_taken(url, field, value):
    r = httpx.post(f"{url}/v1/chat/completions", json={**BODY, field: value}, timeout=60)
    assert r.status_code == 200, r.text


def test_duplicate_tool_names_are_refused(url):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = httpx.post(f"{url}/v1/chat/completions", json={**BODY, "tools": [tool, tool]}, timeout=30)
    assert r.status_code == 400 and "two tools are named 'f'" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "tools"
