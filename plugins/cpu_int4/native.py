"""Finding, building and calling the glmi4 C library (ctypes: no Python headers, no torch).

Where the library comes from, in order:
  1. the copy built by the package build (setuptools ext-module `glmcore_plugins.cpu_int4._glmi4`,
     next to this file), unless the C source beside it is newer (a developer edited it);
  2. a copy compiled on first use from csrc/glmi4.c with the system C compiler ($CC, cc, gcc or
     clang) into the glmcore cache, keyed by the source's hash, so a source checkout works as is.
Both builds use the same flags: -O3, no -march (the fast paths carry their own target attributes and
are chosen at run time), pthreads, no OpenMP, and -DGLMI4_SRC_SHA=<sha256 of glmi4.c>, by which a
library built from an older source is recognised and not used.
"""
from __future__ import annotations

import ctypes as C
import hashlib
import importlib.machinery
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from glmcore.errors import BackendError

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "csrc" / "glmi4.c"
ABI = 12
ISAS = ("plain", "avx2", "avxvnni", "avx512vnni")    # in order of preference (glmi4.c ISA_NAMES)
CFLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-pthread"]

_lib = None
_lib_origin = ""
_verified: dict[int, str] = {}     # isa -> "" (passed) or why it failed the self-test
_tier = None                       # this process's TierChoice (tier_choice)

ENV_ISA = "GLMCORE_INT4_ISA"       # pins the kernel tier as --opt isa= does
TIER_CACHE = "cpu_int4_isa.json"   # the measured tier, in the glmcore cache
TIER_SHAPE = (2048, 2048)          # rows x inputs of the timed matrix: 2.4 MB packed int4
TIER_PREFILL = 32                  # tokens of the timed GEMM (from 32 on the kernels unpack int4 tiles)
TIER_NEAR = 0.95                   # decode within 5% of the fastest: a tie, prefill decides


class Mat(C.Structure):
    _fields_ = [("data", C.c_void_p), ("n", C.c_int32), ("k", C.c_int32), ("n_pad", C.c_int32),
                ("k_pad", C.c_int32), ("bits", C.c_int32), ("group", C.c_int32), ("asym", C.c_int32),
                ("scale_bf16", C.c_int32)]


class Emb(C.Structure):
    _fields_ = [("scales", C.c_void_p), ("mins", C.c_void_p), ("q", C.c_void_p), ("n", C.c_int32),
                ("k", C.c_int32), ("k_pad", C.c_int32), ("bits", C.c_int32), ("group", C.c_int32),
                ("asym", C.c_int32), ("scale_bf16", C.c_int32)]


class Layer(C.Structure):
    _fields_ = [("input_norm", C.c_void_p), ("qkv_bias", C.c_void_p), ("post_norm", C.c_void_p),
                ("post_self_attn_norm", C.c_void_p), ("post_mlp_norm", C.c_void_p), ("qkv", Mat), ("attn_out", Mat),
                ("ffn_up", Mat), ("ffn_down", Mat), ("q_norm", C.c_void_p), ("k_norm", C.c_void_p),
                ("sparse", C.c_int32), ("router", C.c_void_p), ("router_bias", C.c_void_p),
                ("exp_up", C.POINTER(Mat)), ("exp_down", C.POINTER(Mat)), ("shared_up", Mat), ("shared_down", Mat),
                ("q_a_bias", C.c_void_p), ("q_a_norm", C.c_void_p), ("kv_a_bias", C.c_void_p),
                ("kv_a_norm", C.c_void_p), ("attn_out_bias", C.c_void_p), ("q_a", Mat), ("q_b", Mat), ("kv_a", Mat),
                ("kv_uk", Mat), ("kv_uv", Mat)]


class NextN(C.Structure):
    _fields_ = [("enorm", C.c_void_p), ("hnorm", C.c_void_p), ("final_norm", C.c_void_p), ("eh_proj", Mat),
                ("layer", Layer)]


class Spec(C.Structure):
    _fields_ = [("hidden", C.c_int32), ("n_layers", C.c_int32), ("n_heads", C.c_int32), ("n_kv", C.c_int32),
                ("head_dim", C.c_int32), ("ffn", C.c_int32), ("vocab", C.c_int32), ("capacity", C.c_int32),
                ("kv_f16", C.c_int32), ("max_batch", C.c_int32), ("nthreads", C.c_int32), ("isa", C.c_int32),
                ("n_slots", C.c_int32), ("rot_dim", C.c_int32), ("norm_eps", C.c_float), ("rope_cos", C.c_void_p), ("rope_sin", C.c_void_p),
                ("inv_freq", C.c_void_p), ("embed", Emb), ("final_norm", C.c_void_p), ("head", Mat),
                ("layers", C.POINTER(Layer)), ("rope_neox", C.c_int32), ("n_experts", C.c_int32),
                ("top_k", C.c_int32), ("n_groups", C.c_int32), ("topk_groups", C.c_int32), ("norm_topk", C.c_int32),
                ("moe_ffn", C.c_int32), ("shared_ffn", C.c_int32), ("routed_scaling", C.c_float),
                ("mla", C.c_int32), ("q_lora", C.c_int32), ("kv_lora", C.c_int32), ("nope", C.c_int32),
                ("v_dim", C.c_int32), ("latent_eps", C.c_float), ("nextn", C.POINTER(NextN))]


def _declare(lib) -> None:
    P, I, U64 = C.c_void_p, C.c_int, C.c_uint64
    sig = {
        "glmi4_abi_version": (I, []), "glmi4_source_sha": (C.c_char_p, []),
        "glmi4_isa_supported": (I, [I]), "glmi4_isa_name": (C.c_char_p, [I]),
        "glmi4_kernel_calls": (U64, [I]), "glmi4_best_isa": (I, []),
        "glmi4_create": (P, [C.POINTER(Spec), C.c_char_p, I]), "glmi4_destroy": (None, [P]),
        "glmi4_kv_len": (I, [P, I]), "glmi4_reset": (None, [P, I]),
        "glmi4_step": (I, [P, P, P, P, I, P, P, P]),
        "glmi4_draft": (I, [P, I, I, I, P, P, P, P]), "glmi4_shift": (I, [P, I, I, I]),
        "glmi4_copy_prefix": (I, [P, I, I, I]), "glmi4_kv_bytes": (C.c_longlong, [P, I]),
        "glmi4_kv_export": (I, [P, I, I, P]), "glmi4_kv_import": (I, [P, I, I, P]),
        "glmi4_quant_act": (I, [I, P, I, I, I, P, P, P]),
        "glmi4_matmul": (I, [I, C.POINTER(Mat), I, P, P, I]),
        "glmi4_bench_matmul": (C.c_double, [I, C.POINTER(Mat), I, I, I]),
        "glmi4_f2h": (None, [P, P, I]), "glmi4_h2f": (None, [P, P, I]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args


def source_sha() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest() if SOURCE.is_file() else ""


def _prebuilt() -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = HERE / f"_glmi4{suffix}"
        if p.is_file():
            return p
    return None


def _current(handle) -> bool:
    """Built from the source beside us (the build passes its sha256 in), or no source to compare with."""
    src = source_sha()
    return not src or handle.glmi4_source_sha().decode() == src


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc.split()[0]):
            return cc
    return None


def _cache_path() -> Path:
    from glmcore.cache import cache_root
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"glmi4-{digest}-{platform.machine()}.so"


def build_flags() -> list[str]:
    """The compiler flags both builds use, with the source's hash compiled in."""
    return CFLAGS + [f'-DGLMI4_SRC_SHA="{source_sha()}"']


def _compile() -> Path:
    if not SOURCE.is_file():
        raise BackendError(f"cpu_int4: the kernel source {SOURCE} is missing and no prebuilt library was found; "
                           'reinstall: pip install "glmcore[int4]"')
    out = _cache_path()
    if out.is_file():
        return out
    cc = compiler()
    if cc is None:
        raise BackendError("cpu_int4: no prebuilt kernel library and no C compiler (cc, gcc or clang) to build one; "
                           'install a C compiler (e.g. apt install gcc) or reinstall: pip install "glmcore[int4]"')
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    cmd = cc.split() + build_flags() + [str(SOURCE), "-o", tmp, "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        first = (r.stderr.strip().splitlines() or ["no output"])[0]
        raise BackendError(f"cpu_int4: compiling the kernels failed ({' '.join(cmd)}): {first}")
    os.replace(tmp, out)      # atomic: concurrent first uses never load half a file
    return out


def library_path(build: bool = True) -> tuple[Path | None, str]:
    """(path, how it was obtained) without compiling unless build; a stale prebuilt copy is skipped."""
    env = os.environ.get("GLMCORE_INT4_LIB")
    if env:
        return Path(env), "GLMCORE_INT4_LIB"
    pre = _prebuilt()
    if pre is not None:
        try:
            handle = C.CDLL(str(pre))
            handle.glmi4_source_sha.restype = C.c_char_p
            if _current(handle):
                return pre, "built with the package"
        except (OSError, AttributeError):
            pass                    # unloadable or from an older version: build from source instead
    if SOURCE.is_file():
        cached = _cache_path()
        if cached.is_file():
            return cached, "compiled on first use"
    if not build:
        return None, ""
    return _compile(), "compiled on first use"


def lib():
    """The loaded library (compiled on first use when needed)."""
    global _lib, _lib_origin
    if _lib is None:
        path, origin = library_path(build=True)
        try:
            handle = C.CDLL(str(path))
        except OSError as e:
            raise BackendError(f"cpu_int4: cannot load the kernel library {path}: {e}; delete it and retry") from None
        _declare(handle)
        if handle.glmi4_abi_version() != ABI:
            raise BackendError(f"cpu_int4: kernel library {path} is from another version (ABI "
                               f"{handle.glmi4_abi_version()}, need {ABI}); rebuild: pip install -e . (or delete it)")
        _lib, _lib_origin = handle, f"{origin}: {path}"
    return _lib


def origin() -> str:
    lib()
    return _lib_origin


def isa_index(name: str) -> int:
    if name not in ISAS:
        raise BackendError(f"cpu_int4: unknown isa {name!r}; choose auto, {', '.join(ISAS)}")
    return ISAS.index(name)


def supported(name: str) -> bool:
    return bool(lib().glmi4_isa_supported(isa_index(name)))


def expected_isa() -> str:
    """What the dispatcher should pick on this CPU, judged from /proc/cpuinfo alone."""
    from glmcore.cpuinfo import cpu_flags
    f = cpu_flags()
    if {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= f:
        return "avx512vnni"
    if {"avx2", "fma", "f16c", "avx_vnni"} <= f:
        return "avxvnni"
    if {"avx2", "fma", "f16c"} <= f:
        return "avx2"
    return "plain"


def self_test(isa: int) -> str:
    """Compare a fast kernel with the plain C reference on small random matrices ("" when equal)."""
    if isa in _verified:
        return _verified[isa]
    from .quant import quantize4, quantize8, tile4, tile8
    rng = np.random.default_rng(1234)
    why = ""
    for bits, group, sym, sd in ((4, 32, True, "f16"), (4, 64, False, "bf16"), (4, 128, True, "bf16"),
                                 (8, 32, True, "f16")):
        n, k, m = 40, 2 * group + 32 if group < 128 else 256, 6
        w = rng.standard_normal((n, k), dtype=np.float32)
        if bits == 4:
            q, d, mins = quantize4(w, group, sym, sd)
            buf = tile4(q, d, mins, group)
        else:
            q, d = quantize8(w, group, sd)
            buf = tile8(q, d, group)
        mat = make_mat(buf, n, k, bits, group, bits == 4 and not sym, sd)
        x = rng.standard_normal((m, k), dtype=np.float32)
        ref = matmul(mat, x, 0)
        got = matmul(mat, x, isa)
        err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30))
        if not err < 1e-5:
            why = f"{ISAS[isa]} int{bits} g{group} kernel differs from the plain C reference (rel. error {err:.2e})"
            break
    _verified[isa] = why
    return why


def widest_isa() -> tuple[int, str]:
    """The widest kernel variant this CPU has that passes its self-test, and what failed on the way."""
    note = ""
    for i in range(len(ISAS) - 1, 0, -1):
        if supported(ISAS[i]):
            why = self_test(i)
            if not why:
                return i, note
            warnings.warn(f"cpu_int4: {why}; falling back")
            note += f"{why}; "
    return 0, note


def choose_isa(requested: str = "auto") -> tuple[int, str]:
    """The kernel variant to use and why: `requested` (isa=) or GLMCORE_INT4_ISA pins one; otherwise the fastest
    measured on this CPU (tier_choice), or the widest that passes its self-test where measurement is off."""
    from glmcore.autoselect import ENV_OFF, measurement_off
    env = os.environ.get(ENV_ISA, "").strip()
    pinned = requested if requested not in ("auto", "", None) else env if env not in ("", "auto") else ""
    if pinned:
        by = f"{'isa' if pinned == requested else ENV_ISA}={pinned}"
        i = isa_index(pinned)
        if not supported(pinned):
            raise BackendError(f"cpu_int4: {by} is not supported by this CPU; use isa=auto")
        why = self_test(i) if i else ""
        if why:
            raise BackendError(f"cpu_int4: {why}; report this bug, and use isa=plain meanwhile")
        return i, f"pinned by {by}"
    if measurement_off():
        i, note = widest_isa()
        return i, f"the widest that passes its self-test ({ENV_OFF}=0: not measured){'; ' + note if note else ''}"
    choice = tier_choice()
    return isa_index(choice.isa), choice.why


# ---------------------------------------------------------------- the kernel tier by measurement

@dataclass
class TierTiming:
    isa: str
    decode_us: float = 0.0      # one token through the TIER_SHAPE matrix (a decode step's matrix-vector product)
    prefill_us: float = 0.0     # TIER_PREFILL tokens through it (a prefill chunk's, or a batch's, GEMM)
    error: str = ""             # why it was not timed (its self-test failed)


@dataclass
class TierChoice:
    isa: str
    why: str
    timings: list[TierTiming] = field(default_factory=list)
    kernels: str = ""           # the library's source hash: other kernels, other speeds
    measured_at: str = ""
    contention: float | None = None   # other programs' share of the CPUs meanwhile (glmcore.autoselect.Contention)
    tries: int = 1


def decide_tier(timings: list[TierTiming]) -> tuple[str, str]:
    """(isa, why): the fastest decode; among the tiers within TIER_NEAR of it, the fastest prefill. Decode is the
    speed a user waits on, but at real model sizes it is bound by memory bandwidth, where the tiers tie within
    noise; prefill (and a batch of sequences) is compute-bound, where their arithmetic differs."""
    ok = [t for t in timings if not t.error]
    if not ok:
        return "plain", ("no vector tier passed its self-test: " + "; ".join(t.error for t in timings)
                         if timings else "the CPU has no vector tier (AVX2 with FMA and F16C, or better)")
    fastest = min(ok, key=lambda t: t.decode_us)
    near = [t for t in ok if t.decode_us <= fastest.decode_us / TIER_NEAR]
    best = min(near, key=lambda t: t.prefill_us)
    figures = f"decode {best.decode_us:.0f} µs, prefill {best.prefill_us:.0f} µs"
    if len(ok) == 1:
        return best.isa, f"the only vector tier that runs here ({figures})"
    vs = ", ".join(f"{t.isa} {t.decode_us:.0f}/{t.prefill_us:.0f}" for t in ok if t is not best)
    rule = "fastest decode" if best is fastest else \
        f"decode within {100 - 100 * TIER_NEAR:.0f}% of {fastest.isa}'s, faster prefill"
    return best.isa, f"{rule}: {figures} (vs {vs})"


def tier_choice(rerun: bool = False) -> TierChoice:
    """The measured tier, cached in the glmcore cache by version, CPU identity and kernel build (`glmcore backends`
    shows it); measured once per process at most otherwise."""
    global _tier
    from glmcore.autoselect import Contention, read_cached, write_cached
    kernels = lib().glmi4_source_sha().decode()
    if not rerun:
        if _tier is not None:
            return _tier
        raw = read_cached(TIER_CACHE, kernels=kernels)
        try:
            found = TierChoice(raw["isa"], raw["why"], [TierTiming(**t) for t in raw["timings"]], kernels,
                               raw["measured_at"], raw.get("contention"), raw.get("tries", 1)) if raw else None
        except (TypeError, KeyError):
            found = None
        if found is not None and found.isa in ISAS and supported(found.isa) and not self_test(isa_index(found.isa)):
            _tier = found
            return found
    with Contention() as busy:
        timings = measure_tiers()
    isa, why = decide_tier(timings)
    _tier = TierChoice(isa, why, timings, kernels, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), busy.share)
    _tier.tries = write_cached(TIER_CACHE, asdict(_tier), "cpu_int4's kernel tier measurement")
    return _tier


def measure_tiers(rounds: int = 5) -> list[TierTiming]:
    """Every vector tier this CPU runs, timed in alternation (the best of `rounds`) after its self-test; one that
    fails it is listed with why, never timed. The plain C reference is the fallback, not a contender: it is
    15-30x slower than AVX2 (measured on a Zen 3 EPYC) and would take seconds to time."""
    tiers, timings = [], []
    for i in range(len(ISAS) - 1, 0, -1):
        if not supported(ISAS[i]):
            continue
        why = self_test(i)
        if why:
            timings.append(TierTiming(ISAS[i], error=why))
        else:
            tiers.append(i)
    if not tiers:
        return timings
    mat = _tier_matrix()
    best = {i: [float("inf"), float("inf")] for i in tiers}
    for _ in range(rounds):
        for i in tiers:
            for j, (m, iters) in enumerate(((1, 20), (TIER_PREFILL, 4))):
                best[i][j] = min(best[i][j], time_kernel(i, mat, m, iters) * 1e6)
    return [TierTiming(ISAS[i], *best[i]) for i in tiers] + timings


def _tier_matrix() -> Mat:
    """TIER_SHAPE packed int4 (group 32, symmetric, f16 scales: the default), one 16-row tile repeated."""
    from .quant import ROWS, quantize4, tile4
    n, k = TIER_SHAPE
    w = np.random.default_rng(0).standard_normal((ROWS, k), dtype=np.float32)
    q, d, _ = quantize4(w, 32, True, "f16")
    return make_mat(np.tile(tile4(q, d, None, 32), n // ROWS), n, k, 4, 32, False, "f16")


def time_kernel(isa: int, mat: Mat, m: int, iters: int) -> float:
    """Seconds per product of `m` tokens with `mat` on the given tier, with the threads a session uses."""
    from . import default_threads
    secs = lib().glmi4_bench_matmul(isa, C.byref(mat), m, iters, default_threads())
    if secs < 0:
        raise BackendError(f"cpu_int4: timing the {ISAS[isa]} kernels failed")
    return secs


def describe_tier(i: int, why: str) -> dict[str, str]:
    """cpu_int4's probe details about its kernel tier (`glmcore backends`)."""
    from glmcore.autoselect import contention_note
    out = {"isa": ISAS[i], "isa choice": why}
    if _tier is not None and why == _tier.why:
        n, k = TIER_SHAPE
        out["isa timings"] = (f"measured {_tier.measured_at}, int4 {n}x{k} g32, {TIER_PREFILL}-token prefill, µs: "
                              + "; ".join(f"{t.isa} failed its self-test: {t.error}" if t.error else
                                          f"{t.isa} decode {t.decode_us:.0f} prefill {t.prefill_us:.0f}"
                                          for t in _tier.timings)
                              + f" (pin: --opt isa=NAME or {ENV_ISA}=NAME)"
                              + contention_note(_tier.contention, _tier.tries))
    return out


def make_mat(buf: np.ndarray | None, n: int, k: int, bits: int, group: int, asym: bool, scale_dtype: str,
             base: int = 0) -> Mat:
    """A Mat over tile bytes: either a standalone array, or (base != 0) an offset into a mapped file."""
    addr = base if base else buf.ctypes.data
    m = Mat(addr, n, k, -(-n // 16) * 16, -(-k // group) * group, bits, group, int(asym), int(scale_dtype == "bf16"))
    if not base:
        m._keep = buf
    return m


def matmul(mat: Mat, x: np.ndarray, isa: int, threads: int = 1) -> np.ndarray:
    """x [M, k] float32 -> [M, n] with the given kernel variant (tests and self-test)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty((x.shape[0], mat.n), np.float32)
    rc = lib().glmi4_matmul(isa, C.byref(mat), x.shape[0], x.ctypes.data, out.ctypes.data, threads)
    if rc != 0:
        raise BackendError(f"cpu_int4: matmul failed (code {rc})")
    return out


def quant_act(x: np.ndarray, group: int, isa: int):
    """The kernels' int8 activation quantization of one row: (q int8, block scales, group sums)."""
    x = np.ascontiguousarray(x, np.float32)
    kp = -(-x.shape[0] // group) * group
    q, dx, xs = np.empty(kp, np.int8), np.empty(kp // 32, np.float32), np.empty(kp // 32, np.float32)
    rc = lib().glmi4_quant_act(isa, x.ctypes.data, x.shape[0], kp, group, q.ctypes.data, dx.ctypes.data, xs.ctypes.data)
    if rc != 0:
        raise BackendError(f"cpu_int4: quant_act failed (code {rc})")
    return q, dx, xs[: kp // group]
