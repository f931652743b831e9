"""`glmcore serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

A thin layer (DESIGN.md): glmcore.server.exchange turns requests into scheduler Requests and the scheduler's
tokens into JSON / server-sent events; chat formats and tool-call parsing stay in glmcore.chat. Its web
stack (FastAPI, uvicorn, prometheus_client) is the optional extra `glmcore[server]`.
"""
from __future__ import annotations

import ipaddress
import re
import signal
import socket
import sys
from dataclasses import dataclass, field

from ..engine.speculative import Speculation
from ..errors import GlmcoreError
from ..sampling import SamplingParams

INSTALL = 'pip install "glmcore[server]"'
MAX_HEAD = 64 << 10          # bytes of a request line and headers (h11's own limit is 16 KiB)


@dataclass
class ServeOptions:
    """How `glmcore serve` listens and schedules (what to load is load_model's: model, backend, LoadOptions)."""
    host: str = "127.0.0.1"
    port: int = 8000
    slots: int = 4                   # sequences decoded together (per replica)
    token_budget: int = 256          # tokens per batched step
    max_queue: int = 64              # requests waiting for a slot before 429
    api_key: str | None = None       # required as 'Authorization: Bearer KEY' when set
    name: str | None = None          # the model id clients send (default: the model directory's name)
    max_body: int | None = None      # largest request body in bytes (default: app.MAX_BODY)
    grace_s: float = 10.0            # running requests get this long to finish on SIGTERM
    read_timeout: float = 30.0       # seconds a request's head, and then its body, may take to arrive
    log_level: str = "warning"
    replicas: int = 1                # >1 (or a ray_address): replicas on Ray Serve (glmcore[ray])
    ray_address: str | None = None
    allowed_hosts: tuple = ()        # names the Host header may give besides the listening address and localhost
    cors_origins: tuple = ()         # web origins whose pages may call the API (CORS); none by default
    speculation: Speculation = field(default_factory=Speculation)    # speculative decoding (--speculative)
    max_thinking_tokens: int | None = None   # a thinking model's thought, where a request names no budget
    cache_ram: int | None = None     # MiB of host RAM for the prompt cache; 0: off; None: the default where it works

    def check(self) -> None:
        """GlmcoreError for options that cannot be served, before anything is loaded."""
        if self.api_key is not None and not self.api_key.strip():
            raise GlmcoreError("--api-key is empty (was it given an unset variable, as in --api-key \"$KEY\"?); "
                               "give a key, or leave the option out to serve without one")
        if self.max_queue < 0:
            raise GlmcoreError(f"invalid --max-queue {self.max_queue}: use 0 or more")
        if not 0 <= self.port <= 65535:
            raise GlmcoreError(f"invalid --port {self.port}: use 0..65535 (0: any free port)")
        if self.grace_s < 0:
            raise GlmcoreError(f"invalid --grace {self.grace_s}: use 0 or more seconds")
        if self.max_thinking_tokens is not None and self.max_thinking_tokens < 0:
            raise GlmcoreError(f"invalid --max-thinking-tokens {self.max_thinking_tokens}: use 0 or more (-1 or "
                               "leave it out: no limit)")
        if not self.read_timeout > 0:
            raise GlmcoreError(f"invalid --read-timeout {self.read_timeout}: use a positive number of seconds")
        for origin in self.cors_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise GlmcoreError(f"invalid --cors-origins entry {origin[:60]!r}: give origins such as "
                                   "http://localhost:3000 (scheme://host[:port], no path)")

    def hosts(self, bound_host: str) -> list[str]:
        """The Host names served: the listening address, localhost and --allowed-hosts; any ("*") when
        listening on every interface without --allowed-hosts (the machine's names are not known here)."""
        if not self.allowed_hosts and bound_host in ("0.0.0.0", "::", ""):
            return ["*"]
        from .app import LOCAL_HOSTS
        return [*LOCAL_HOSTS, bound_host, *self.allowed_hosts]


def require_stack() -> None:
    missing = []
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise GlmcoreError(f"the server needs {', '.join(missing)}, which is not installed; fix: {INSTALL}")


def uvicorn_config(app, read_timeout: float = 30.0, **kw):
    """uvicorn's Config for the app, with a read timeout on request heads: uvicorn has none, so a client that
    drips a header byte every few seconds would hold its connection forever (the body's timeout is the app's,
    glmcore.server.exchange.read_body)."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadTimeout(AutoHTTPProtocol):
        """Closes a connection whose request head is not complete `read_timeout` s after its first byte
        (or after the connection opened). A new head is complete when the protocol starts a new cycle."""
        _head_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def _arm(self):
            self._head_cycle, self._head_bytes = self.cycle, 0
            self._head_timer = self.loop.call_later(read_timeout, self._head_late)

        def data_received(self, data):
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()          # the first byte of the next request on a kept-alive connection
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._head_cycle:
                self._head_timer.cancel()
                self._head_timer = None
            elif self._head_timer is not None:
                # still in the head: httptools buffers header fields without a limit, so a fast client
                # could send gigabytes of one header within the timeout
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD and not self.transport.is_closing():
                    self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
                                         b"content-length: 0\r\n\r\n")
                    self.transport.close()

        def _head_late(self):
            self._head_timer = None
            if self.cycle is self._head_cycle and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    return uvicorn.Config(app, http=HeadTimeout, **kw)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise GlmcoreError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port or --host") \
            from None
    sock.listen(128)
    return sock


def _startup_lines(model, so: ServeOptions, sock, name: str) -> None:
    """Where it listens, what it runs, what requests sample with when they leave it out."""
    bound_host, bound_port = sock.getsockname()[:2]
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    batch = model.scheduler.batch
    base = f"http://{url_host}:{bound_port}"
    print(f"glmcore serve: chat page {base}/ | API {base}/v1 | model {name} ({model.config.family}, {model.model_dir}) "
          f"| backend {model.backend.name} ({'native batched steps' if model.scheduler.native else 'core adapter'}) | "
          f"{batch.n_slots} slots, context {batch.capacity}, token budget {so.token_budget}"
          + (f" | prompt cache {cache.budget >> 20} MiB" if (cache := model.scheduler.table.cache) else "")
          + (" | API key required" if so.api_key else ""), file=sys.stderr, flush=True)
    d = model.sampling
    print(f"glmcore serve: requests that leave them out sample with temperature {d.temperature:g}, top_p {d.top_p:g}, "
          f"top_k {d.top_k}, repetition_penalty {d.repetition_penalty:g}"
          + (" (the checkpoint's recommendation)" if d != SamplingParams() else ""), file=sys.stderr, flush=True)
    if not so.api_key and not ipaddress.ip_address(bound_host).is_loopback:
        print(f"warning: listening on {bound_host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr, flush=True)


def serve(model_dir, backend, options, so: ServeOptions) -> int:
    """Load the model with `so.slots` sequences, serve until SIGTERM/SIGINT: then stop accepting, let running
    requests finish for so.grace_s, cancel the rest and return 0."""
    require_stack()
    import uvicorn

    from ..model import load_model
    from .app import MAX_BODY, create_app

    so.check()
    sock = _bind(so.host, so.port)
    model = load_model(model_dir, backend, options, slots=so.slots, token_budget=so.token_budget,
                       speculation=so.speculation, cache_ram=so.cache_ram)
    model.scheduler.max_queue = so.max_queue
    name = so.name or model.model_dir.name
    app = create_app(model, name, so.api_key, so.max_body or MAX_BODY, read_timeout=so.read_timeout,
                     allowed_hosts=so.hosts(sock.getsockname()[0]), cors_origins=so.cors_origins,
                     thinking_budget=so.max_thinking_tokens)
    config = uvicorn_config(app, so.read_timeout, log_level=so.log_level, timeout_graceful_shutdown=so.grace_s,
                            access_log=False)
    server = uvicorn.Server(config)
    model.scheduler.start()
    # a SIGTERM/SIGINT from here on stops the server: before uvicorn takes the signals over it asks for the
    # exit that uvicorn checks once started; after uvicorn's graceful stop it meets the signal uvicorn re-raises
    previous = {sig: signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _startup_lines(model, so, sock, name)
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        model.scheduler.stop(0)     # uvicorn already gave running requests their grace period
        model.close()
        sock.close()
    print("glmcore serve: stopped", file=sys.stderr, flush=True)
    return 0
