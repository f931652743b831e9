"""`glmcore serve --replicas N`: N copies of the server's engine behind Ray Serve's HTTP proxy.

Each replica is one Ray actor process with its own backend, scheduler and the same FastAPI app as
`glmcore serve` (glmcore.server.app.create_app); Ray's proxy routes the OpenAI-compatible endpoints
to them and Ray restarts a replica whose process dies. `--tp M` splits each replica's model over M
ranks (the replica's process is rank 0 and starts the others), so replicas x tp processes compute.

By default a local Ray instance is started for the command and shut down with it, kept on this host:
usage stats off, no dashboard, every Ray server on the loopback interface. `--ray-address` joins a
running cluster instead (its own settings apply); then only this application is removed on exit.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading

from ..errors import GlmcoreError

INSTALL = 'pip install "glmcore[ray]"'
APP = "glmcore"
# No usage reports; and Ray takes the loopback address as this node's (the single-host mode it uses on
# macOS and Windows) instead of the host's network address, so every Ray server binds 127.0.0.1.
LOCAL_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class Replica:
    """One replica: the model loaded with slots, its scheduler running, and the server's app over it
    (Ray Serve's ingress asks for the app through __serve_build_asgi_app__ after __init__)."""

    def __init__(self, model_dir, backend, options, so, loopback: bool):
        from ..model import load_model
        from .app import create_app
        if loopback:
            _loopback_grpc()
        # (Ray's ingress wrapper owns the attribute names `app` and the like: ours are prefixed)
        self.glm_model = load_model(model_dir, backend, options, slots=so.slots, token_budget=so.token_budget,
                                    speculation=so.speculation, cache_ram=so.cache_ram)
        self.glm_model.scheduler.max_queue = so.max_queue
        self.glm_app = create_app(self.glm_model, so.name, so.api_key, so.max_body, read_timeout=so.read_timeout,
                                  allowed_hosts=so.hosts(so.host), cors_origins=so.cors_origins,
                                  thinking_budget=so.max_thinking_tokens)
        self.glm_model.scheduler.start()

    def __serve_build_asgi_app__(self):
        return self.glm_app

    def __del__(self):      # Ray Serve's graceful replica shutdown
        model = getattr(self, "glm_model", None)
        if model is not None:
            model.close()


def _loopback_grpc() -> None:
    """Ray Serve starts each replica's inter-deployment gRPC server on [::]:0 (every interface) after the
    replica's constructor; on a local instance every peer is on this host, so it binds 127.0.0.1 instead
    (the node address Ray gives its peers there)."""
    from ray.serve._private import replica
    add = getattr(replica, "add_port_to_grpc_server", None)
    if add is not None and not getattr(add, "glmcore_loopback", False):
        def loopback(server, address):
            return add(server, address.replace("[::]", "127.0.0.1"))
        loopback.glmcore_loopback = True
        replica.add_port_to_grpc_server = loopback


def _require_ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise GlmcoreError(f"--replicas and --ray-address need Ray Serve, which is not installed; fix: {INSTALL}") \
            from None
    return ray, serve


def serve_replicas(model_dir, backend, options, so) -> int:
    """Deploy `so.replicas` copies of the model's server on Ray Serve and serve until SIGTERM/SIGINT."""
    from . import require_stack
    from ..model import demo_model_dir, open_checkpoint, resolve_backend
    from .app import MAX_BODY
    require_stack()
    replicas, port, log_level, ray_address = so.replicas, so.port, so.log_level, so.ray_address
    if replicas < 1:
        raise GlmcoreError(f"invalid --replicas {replicas}: use 1 or more")
    if not 1 <= port <= 65535:
        raise GlmcoreError(f"invalid --port {port}: Ray Serve's proxy needs a fixed port, 1..65535")
    # Refuse what would fail in every replica (after Ray's retries, with a traceback) here, at once.
    model_dir = os.path.abspath(model_dir) if model_dir else str(demo_model_dir())
    resolve_backend(backend, open_checkpoint(model_dir).config)
    local = ray_address is None
    # Ray reads these when it is imported; its processes inherit them.
    os.environ.update(LOCAL_RAY_ENV if local else {"RAY_USAGE_STATS_ENABLED": "0"})
    ray, serve = _require_ray()
    per_replica = max(1, options.tp)
    if options.threads is None:     # the replicas (and their ranks) share this machine's cores
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        options.threads = max(1, cpus // (replicas * per_replica))
    if local:
        ray.init(num_cpus=replicas * per_replica, include_dashboard=False, namespace=APP,
                 logging_level=log_level.upper())
    else:
        ray.init(address=ray_address, namespace=APP, logging_level=log_level.upper())
    try:
        so = dataclasses.replace(so, name=so.name or os.path.basename(model_dir.rstrip("/")),
                                 max_body=so.max_body or MAX_BODY)
        deployment = serve.deployment(serve.ingress()(Replica), name=APP, num_replicas=replicas,
                                      ray_actor_options={"num_cpus": per_replica},
                                      max_ongoing_requests=so.slots + so.max_queue)
        serve.start(http_options={"host": so.host, "port": port})
        try:
            serve.run(deployment.bind(model_dir, backend, options, so, local), name=APP, route_prefix="/")
        except RuntimeError as e:
            raise GlmcoreError(f"Ray Serve could not start the replicas ({str(e).splitlines()[0]}); the replica's "
                               "error is in the log above") from None
        print(f"glmcore serve: http://{so.host}:{port}/v1 | model {so.name} | {replicas} replicas on Ray Serve "
              f"({'a local Ray instance' if local else ray_address}) | backend {backend or 'default'}"
              f"{f' tp={options.tp}' if options.tp > 1 else ''} | {so.slots} slots per replica",
              file=sys.stderr, flush=True)
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not stop.wait(1.0):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        if local:
            serve.shutdown()
        else:
            serve.delete(APP)
        ray.shutdown()
    print("glmcore serve: stopped", file=sys.stderr, flush=True)
    return 0
