"""Backend `tpu_bm1684x`: the Sophgo BM1684X deployment of GLM as a fixed set of static graphs.

The BM1684X runs no dynamic shapes, so the network is exported (torch.onnx.export) as per-layer
static graphs with a fixed context SEQ_LEN: embedding, block_N (prefill), block_cache_N (decode
against a SEQ_LEN K/V window), lm_head (logits) and greedy_head (top-1 id from the logits, no
weights). The host moves the KV cache.

Runtimes, chosen per load:
  device           sophon.sail runs the combined bmodel compiled from the parts (`--opt bmodel=PATH`)
  host emulation   onnxruntime runs the exact exported ONNX parts, f32 or f16 (RMSNorm in f32)

`glmcore convert --backend tpu_bm1684x` writes the f32 parts TPU-MLIR compiles (TorchScript .pt for
the parts too big for one protobuf), quantize tables, a compile script (model_transform /
model_deploy --chip bm1684x / model_tool --combine), and runs it when TPU-MLIR's commands are on PATH.
Backend-specific options (`--opt KEY=VALUE`): seq_len (default 512; or --ctx), runtime=auto|host|device,
bmodel=PATH, device_id=N; convert also takes quantize (default W8F16, W8BF16 for GLM-4) and group_size
(default 64: --q_group_size for the W4*/W8* modes; TPU-MLIR versions without per-group W8 ignore it there).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from glmcore.backend import Backend, Capabilities, LoadOptions, Probe, default_capacity, hookimpl, kernels_run
from glmcore import arch
from glmcore.errors import BackendError

from .spec import DEFAULT_SEQ_LEN, PROTOBUF_LIMIT, TORCH_OPSET, default_quantize

HOST_MODULES = ("torch", "onnx", "onnxruntime")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def sail_status() -> tuple[bool, str]:
    """Whether the Sophon runtime can run a bmodel here, and why (not)."""
    try:
        import sophon.sail as sail
    except Exception as e:        # absent, or present without its driver libraries
        return False, f"device runtime sophon.sail not importable ({type(e).__name__})"
    try:
        n = sail.get_available_tpu_num()
    except Exception as e:
        return False, f"sophon.sail imported but no TPU answered ({type(e).__name__}: {e})"
    if n < 1:
        return False, "sophon.sail imported but no BM1684X device found"
    return True, f"sophon.sail {_version('sophon')}, {n} TPU device(s)"


def host_missing() -> list[str]:
    return [m for m in HOST_MODULES if importlib.util.find_spec(m) is None]


class TpuBm1684xBackend(Backend):
    name = "tpu_bm1684x"
    option_keys = ("runtime", "bmodel", "device_id", "seq_len", "quantize", "group_size")
    extra = "tpu"
    description = "Sophgo BM1684X static graphs (TPU-MLIR); onnxruntime host emulation elsewhere"

    def probe(self) -> Probe:
        from .compile import tpu_mlir_status
        device_ok, device_why = sail_status()
        missing = host_missing()
        if device_ok:
            runtime = f"device ({device_why}); load a compiled bmodel with --opt bmodel=PATH"
        elif not missing:
            runtime = f"host emulation (onnxruntime {_version('onnxruntime')}); {device_why}"
        else:
            runtime = f"none: {device_why}, and host emulation needs {', '.join(missing)}"
        details = {"runtime": runtime,
                   "seq_len": f"{DEFAULT_SEQ_LEN} by default (--ctx N or --opt seq_len=N; capacity = SEQ_LEN)",
                   "exporter": (f"torch {_version('torch')} + onnx {_version('onnx')} (torch.onnx.export, opset "
                                f"{TORCH_OPSET})" if "torch" not in missing and "onnx" not in missing
                                else "needs torch and onnx")}
        details["compiler"] = tpu_mlir_status()[1]
        details["verified"] = ("host emulation runs in the tests against the torch reference; the sail runtime path "
                               "only against a stand-in that follows sophon-sail's binding (update_data's shape and "
                               "dtype checks) and names .pt parts' tensors as TPU-MLIR does (tensors addressed by "
                               "position), compile.sh against stub TPU-MLIR tools, quantize tables against the op "
                               "names of the graph each is applied to; neither on a BM1684X")
        if not device_ok and missing:
            return Probe(False, device="cpu", reason=f"{', '.join(missing)} not installed (needed to export and "
                         f"emulate the static graphs) and {device_why}", install=self.install_hint(), details=details)
        return Probe(True, device="bm1684x" if device_ok else "cpu (host emulation)", details=details)

    def capabilities(self) -> Capabilities:
        # Host emulation is for checking the graphs, not for speed: never the default backend there.
        try:
            on_device = importlib.util.find_spec("sophon") is not None
        except (ImportError, ValueError):
            on_device = False
        return Capabilities(precisions=("f32", "f16"), weight_formats=("f32", "f16"), default_precision="f32",
                            default_weights="f32", max_context=None, can_shift=False,
                            speed_rank=100 if on_device else -1)   # emulation is for checking graphs, not speed

    def supports(self, config) -> str | None:
        return kernels_run(self, config, ("glm",))

    def architectures(self) -> list[str]:
        return [arch.get("glm").describe()]

    def resolve(self, options: LoadOptions) -> LoadOptions:
        # The graphs hold their weights in the compute precision: either option implies the other.
        if (options.weights is None) != (options.precision is None):
            both = options.precision or options.weights
            if options.weights is not None and both not in self.capabilities().weight_formats:
                raise BackendError(f"backend {self.name!r} has no weight format {both!r}; choose one of "
                                   f"{', '.join(self.capabilities().weight_formats)}")
            options = LoadOptions(both, both, options.capacity, options.threads, options.cache_dir,
                                  dict(options.extra))
        opts = super().resolve(options)
        if opts.weights != opts.precision:
            raise BackendError(f"tpu_bm1684x has no {opts.precision} compute over {opts.weights} weights: its graphs "
                               "hold the weights in the compute precision; pass only --precision (f32 or f16)")
        return opts

    # ------------------------------------------------------------ load

    def load(self, config, weights, options: LoadOptions):
        from .session import StaticGraphSession
        opts = self.resolve(options)
        runtime = str(opts.extra.get("runtime", "auto"))
        if runtime not in ("auto", "host", "device"):
            raise BackendError(f"unknown --opt runtime={runtime}; choose auto, host or device")
        bmodel = opts.extra.get("bmodel")
        if bmodel is not None and not Path(str(bmodel)).is_file():
            raise BackendError(f"--opt bmodel={bmodel}: no such file; pass the .bmodel that TPU-MLIR built from "
                               "`glmcore convert --backend tpu_bm1684x`")
        device_ok, device_why = sail_status() if runtime != "host" else (False, "")
        if runtime == "device" and not device_ok:
            raise BackendError(f"--opt runtime=device: {device_why}; install the Sophon SDK's sophon.sail on the "
                               "BM1684X host, or use --opt runtime=host")
        if runtime == "device" or (runtime == "auto" and device_ok and bmodel):
            return self._load_device(config, opts, bmodel, StaticGraphSession)
        missing = host_missing()
        if missing:
            hint = " (or pass --opt bmodel=PATH for the device runtime)" if device_ok else ""
            raise BackendError(f"host emulation needs {', '.join(missing)}: {self.install_hint()}{hint}")
        from .export import export_parts, is_current, manifest_key
        from .session import OrtRunner
        seq_len = self.seq_len(config, opts)
        dtype = opts.precision
        cache = Path(opts.cache_dir) if opts.cache_dir else _default_cache()
        parts = cache / "tpu_bm1684x" / f"{weights.fingerprint()}-seq{seq_len}-{dtype}"
        if not is_current(parts, manifest_key(config, weights.fingerprint(), seq_len, dtype)):
            _notice(f"tpu_bm1684x: exporting the static graphs (SEQ_LEN={seq_len}, {dtype}) to {parts}; "
                    "done once per model and options")
        manifest = export_parts(config, weights, seq_len, dtype, parts)
        return StaticGraphSession(OrtRunner(parts, manifest, opts.threads), config, seq_len)

    def _load_device(self, config, opts, bmodel, session_cls):
        if not bmodel or not Path(bmodel).is_file():
            raise BackendError(f"the device runtime needs a compiled bmodel: --opt bmodel=PATH (got {bmodel!r}); "
                               "make one with `glmcore convert --backend tpu_bm1684x` and its compile.sh")
        from .session import SailRunner
        runner = SailRunner(bmodel, int(opts.extra.get("device_id", 0)))
        seq_len = runner.seq_len()
        if runner.num_layers() != config.num_layers:
            raise BackendError(f"{bmodel} has {runner.num_layers()} layers but the model {config.num_layers}; "
                               "it was compiled from another checkpoint")
        if opts.capacity not in (None, seq_len):
            raise BackendError(f"{bmodel} was compiled for SEQ_LEN={seq_len}; drop --ctx or recompile with --seq-len")
        return session_cls(runner, config, seq_len)

    def seq_len(self, config, opts: LoadOptions) -> int:
        """The static context: --ctx (capacity) or --opt seq_len, default 512 (bounded by the model)."""
        raw = opts.extra.get("seq_len")
        try:
            s = None if raw is None else int(raw)
        except (TypeError, ValueError):
            raise BackendError(f"invalid seq_len {raw!r}: use a positive integer, e.g. --opt seq_len=512") from None
        if s is not None and opts.capacity is not None and s != opts.capacity:
            raise BackendError(f"--ctx {opts.capacity} and seq_len {s} disagree; the static context is the "
                               "capacity: pass only one")
        n = opts.capacity if opts.capacity is not None else s if s is not None else min(DEFAULT_SEQ_LEN,
                                                                                       config.max_seq_len)
        if n < 2:
            raise BackendError(f"invalid seq_len {n}: use at least 2")
        return default_capacity(config, self.capabilities(), n)

    # ------------------------------------------------------------ convert

    def convert(self, config, weights, options: LoadOptions, out: Path, progress) -> None:
        from .compile import bmodel_name, check_quantize, run_script, tpu_mlir_status, write_qtables, write_script
        from .export import export_parts
        missing = host_missing()
        if "torch" in missing or "onnx" in missing:
            raise BackendError(f"exporting the ONNX parts needs torch and onnx: {self.install_hint()}")
        out = Path(out)
        quantize = check_quantize(options.extra.get("quantize"), default_quantize(config.family))
        try:
            group_size = int(options.extra.get("group_size", 64))
        except (TypeError, ValueError):
            group_size = 0
        if group_size < 1:
            raise BackendError(f"invalid group_size {options.extra.get('group_size')!r}: use a positive integer "
                               "such as 64 (the W4*/W8* modes' quantization group)")
        seq_len = self.seq_len(config, options)
        progress(f"{config.num_layers * 2 + 4} ONNX parts (SEQ_LEN={seq_len}, f32: TPU-MLIR quantizes them) in "
                 f"{out / 'onnx'}")
        manifest = export_parts(config, weights, seq_len, "f32", out / "onnx", progress)
        torchscript = export_big_parts(config, weights, manifest, out / "onnx", progress)
        write_qtables(manifest, out, torchscript)
        script = write_script(manifest, out, config.family, quantize, group_size, frozenset(torchscript))
        progress(f"wrote {script} (--quantize {quantize}, RMSNorm in F32)")
        bmodel = out / bmodel_name(config.family, quantize, seq_len)
        ok, why = tpu_mlir_status()
        if not ok:
            progress(f"not compiling: {why}; run {script} where TPU-MLIR is installed to build {bmodel.name}")
            return
        progress("compiling with TPU-MLIR")
        run_script(out, quantize, progress)
        progress(f"on the BM1684X host: glmcore run --backend tpu_bm1684x --model MODEL --opt bmodel={bmodel}")


def export_big_parts(config, weights, manifest: dict, onnx_dir: Path, progress) -> frozenset:
    """TorchScript twins of the parts whose f32 weights reach the protobuf limit (GLM-4's 151,552 x 4,096
    embedding and output layer: 2.5 GB each). TPU-MLIR's ONNX loader (OnnxConverter.load_onnx_model)
    reads external data back into one in-memory ModelProto, which its constant folding and onnxsim
    steps serialize; LLM-TPU compiles exactly these two GLM4 parts from .pt. Returns {part name: the
    TPU-MLIR op names of its RMSNorm in the .pt graph} for the quantize tables (embedding_cache is
    compiled from embedding.pt too)."""
    from .graphs import export_torchscript, group_weights, torchscript_op_names
    if config.vocab_size * config.hidden_size * 4 < PROTOBUF_LIMIT:     # their one big matrix, in f32
        return {}
    specs = {p["name"]: p for p in manifest["parts"]}
    f32_ops = {}
    for name in ("embedding", "lm_head"):
        progress(f"{name}: f32 weights exceed one protobuf (2 GiB): writing {name}.pt for TPU-MLIR")
        arrays = group_weights(config, weights, specs[name]["group"], manifest["key"]["seq_len"], "f32")
        export_torchscript(specs[name], config, arrays, onnx_dir / f"{name}.pt")
        f32_ops[name] = torchscript_op_names(onnx_dir / f"{name}.pt")[1]
    f32_ops["embedding_cache"] = f32_ops["embedding"]
    return f32_ops


def _notice(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _default_cache() -> Path:
    from glmcore.cache import cache_root
    return cache_root() / "converted"


@hookimpl
def glmcore_backends():
    return [TpuBm1684xBackend()]
