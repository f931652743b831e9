"""llama.cpp beside glmcore on the same checkpoint: an optional comparison for the benchmarks.

Never a requirement of the tests or CI: `glmcore bench` and benchmarks/bench_openvino_amx.py add a llama.cpp
column only when $GLMCORE_LLAMACPP names a built llama.cpp source tree. To get one (the llama.cpp that the
llama-cpp-python wheel vendors, built for this CPU; several minutes on 2 cores):

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/llamacpp
    python -m glmcore_conformance.llamacpp build /tmp/llamacpp/llama_cpp_python-0.3.36.tar.gz --dir /tmp/llamacpp
    export GLMCORE_LLAMACPP=/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp     (the path it prints)

The checkpoint is converted once by llama.cpp's own convert_hf_to_gguf.py (it reads the ChatGLM layout: ChatGLM2/3
and GLM-4-9B-chat) to an f16 GGUF, with the vocabulary given from tokenizer.model by our tokenizer code
(sentencepiece, or GLM-4's tiktoken ranks; its converter would run the checkpoint's remote tokenizer code
instead), then llama-quantize makes the type that matches a weight format:
int8 -> Q8_0, int4 -> Q4_0 (llama.cpp's defaults: Q4_0 keeps the output layer in Q6_K). The files are cached
under $GLMCORE_CACHE/converted/llamacpp. Timing is llama-bench's: prompt processing of the prompt length, then
generation of the new tokens after `depth` tokens of context (the benchmarks pass the prompt length, as their
own decode follows the prompt: a second llama-bench run with -d), one repetition per call so a caller can
alternate it with its own runs. Peak RSS is the
llama-bench process's (mapped model pages it touched included). `LlamaServer` runs llama-server (built on demand
by `build_targets(root, ["llama-server"])`) on the loopback for its chat template rendering.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from glmcore.errors import GlmcoreError

ENV = "GLMCORE_LLAMACPP"
# the families whose checkpoints convert_hf_to_gguf.py reads: the ChatGLM layout, and the MoE GLMs (llama.cpp's
# glm4moe, and deepseek2 for GLM-4.7-Flash's latent attention)
LAYOUTS = ("chatglm2", "chatglm3", "glm4", "glm4-moe", "glm4-moe-lite")
GGUF_TYPES = {"int8": "Q8_0", "int4": "Q4_0", "f16": "F16", "bf16": "BF16", "f32": "F32"}
TARGETS = ("llama-bench", "llama-quantize")


@dataclass
class LlamaCpp:
    root: Path      # llama.cpp source tree: convert_hf_to_gguf.py, gguf-py/, build/bin/

    def tool(self, name: str) -> Path:
        return self.root / "build" / "bin" / name

    def version(self) -> str:
        out = subprocess.run([str(self.tool("llama-bench")), "--version"], capture_output=True, text=True,
                             timeout=60)
        text = (out.stdout + out.stderr).strip().splitlines()
        return text[0] if text else "unknown"

    def gguf(self, model_dir: Path, weights: str, progress=lambda m: None) -> Path:
        """The checkpoint as a GGUF of the type matching `weights`, converted once into the cache."""
        from glmcore.cache import build_once, cache_root, intact
        from glmcore.config import ModelConfig
        from glmcore.generated import GeneratedWeights
        from glmcore.weights import load_weights
        qtype = GGUF_TYPES.get(weights)
        if qtype is None:
            raise GlmcoreError(f"llama.cpp has no counterpart of weight format {weights!r}")
        cfg = ModelConfig.from_dir(model_dir)
        if cfg.family not in LAYOUTS:
            raise GlmcoreError(f"llama.cpp comparison: only {', '.join(LAYOUTS)}, not {cfg.family}")
        weights_read = load_weights(model_dir, cfg)
        if isinstance(weights_read, GeneratedWeights):     # its converter reads weight files: it would write none
            raise GlmcoreError(f"llama.cpp comparison: {model_dir} has no weight files (make-model "
                               "--generated-weights); make it without --generated-weights for llama.cpp's converter")
        key = weights_read.fingerprint()
        root = cache_root() / "converted" / "llamacpp" / f"{Path(model_dir).name}-{key}"
        done = lambda p: (p / "model.gguf").is_file()
        if qtype == "F16":
            return build_once(root / "f16", lambda tmp: self._convert(model_dir, tmp / "model.gguf", progress),
                              complete=done) / "model.gguf"

        def quantize(tmp: Path) -> None:
            # An f16 GGUF kept from an F16 comparison is reused; otherwise it is only a step on the way (19 GB
            # at the 9B shape), made beside the result and deleted.
            f16 = root / "f16" / "model.gguf"
            if not (f16.is_file() and intact(f16.parent)):
                f16 = tmp / "f16.gguf"
                self._convert(model_dir, f16, progress)
            self._quantize(f16, tmp / "model.gguf", qtype, progress)
            (tmp / "f16.gguf").unlink(missing_ok=True)
        return build_once(root / qtype, quantize, complete=done) / "model.gguf"

    def _convert(self, model_dir: Path, out: Path, progress) -> None:
        progress(f"llama.cpp: converting {model_dir} to GGUF (convert_hf_to_gguf.py, once)")
        _run([sys.executable, "-m", "glmcore_conformance.llamacpp", "convert", str(self.root), str(model_dir),
              str(out)], "convert_hf_to_gguf.py")

    def _quantize(self, f16: Path, out: Path, qtype: str, progress) -> None:
        progress(f"llama.cpp: llama-quantize to {qtype} (once)")
        _run([str(self.tool("llama-quantize")), str(f16), str(out), qtype], "llama-quantize")

    def bench(self, gguf: Path, prompt_len: int, gen: int, threads: int | None, depth: int = 0) -> dict:
        """One llama-bench repetition: prefill tok/s of prompt_len tokens, decode tok/s of gen tokens after `depth`
        tokens of context (llama-bench -d, a second run: its depth applies to both tests; 0: after none), and
        the peak RSS of the process(es)."""
        common = ["-m", str(gguf), "-r", "1", "-t", str(threads or os.cpu_count() or 1), "-o", "json"]
        if depth:
            rows, peak = self._bench([*common, "-p", str(prompt_len), "-n", "0"])
            decode, peak_d = self._bench([*common, "-p", "0", "-n", str(gen), "-d", str(depth)])
            rows, peak = [r for r in rows if r["n_prompt"]] + [r for r in decode if not r["n_prompt"]], max(peak, peak_d)
        else:
            rows, peak = self._bench([*common, "-p", str(prompt_len), "-n", str(gen)])
        tps = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
        return {"prefill_tps": tps["prefill"], "decode_tps": tps["decode"], "peak_rss_mib": peak}

    def _bench(self, args: list[str]) -> tuple[list[dict], float]:
        """llama-bench's JSON rows and its peak RSS in MiB (nan where unknown)."""
        cmd = [str(self.tool("llama-bench")), *args]
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            # Started through a small launcher: a child forked straight from this (large) process would
            # report this process's resident size as its own peak (Linux carries the high-water mark of
            # the address space it forked from into the child's rusage).
            proc = subprocess.Popen([sys.executable, "-c", _REAPER, *cmd], stdout=out, stderr=err, text=True)
            watchdog = threading.Timer(1800, proc.kill)
            watchdog.start()
            code = proc.wait()
            watchdog.cancel()
            out.seek(0)
            err.seek(0)
            errors = err.read()
            if code:
                raise GlmcoreError(f"llama-bench failed (exit {code}): {errors.strip()[-300:]}")
            out = out.read()
        peak_kb = [int(line.split("=", 1)[1]) for line in errors.splitlines() if line.startswith(_PEAK)]
        return json.loads(out), (peak_kb[-1] / 1024 if peak_kb else float("nan"))

    def kl_base(self, gguf: Path, text: Path, ctx: int, out: Path, chunks: int | None = None,
                threads: int | None = None) -> None:
        """llama-perplexity --kl-divergence-base: the log-probabilities of `gguf` on `text` kept in `out`."""
        _run([str(self.tool("llama-perplexity")), "-m", str(gguf), "-f", str(text), "-c", str(ctx),
              *(["--chunks", str(chunks)] if chunks else []), "-t", str(threads or os.cpu_count() or 1),
              "--kl-divergence-base", str(out)], "llama-perplexity")

    def kl_divergence(self, gguf: Path, base: Path, threads: int | None = None) -> dict:
        """llama-perplexity --kl-divergence of `gguf` against a kl_base file: KL mean and 99th percentile per
        token, and how often both pick the same top-1 token (from its summary)."""
        r = subprocess.run([str(self.tool("llama-perplexity")), "-m", str(gguf), "--kl-divergence-base", str(base),
                            "--kl-divergence", "-t", str(threads or os.cpu_count() or 1)],
                           capture_output=True, text=True, timeout=3600)
        found = dict(re.findall(r"^(Mean    KLD|99\.0%   KLD|Same top p):\s*(-?[\d.]+)", r.stdout + r.stderr, re.M))
        if r.returncode or len(found) != 3:
            raise GlmcoreError(f"llama-perplexity --kl-divergence failed (exit {r.returncode}): "
                               f"{(r.stderr or r.stdout).strip()[-500:]}")
        return {"kl_mean": float(found["Mean    KLD"]), "kl_p99": float(found["99.0%   KLD"]),
                "top1": float(found["Same top p"]) / 100}


_PEAK = "GLMCORE_CHILD_MAXRSS_KB="
# Runs argv[1:], reaps it with its own rusage and reports its peak RSS on stderr; exits with its code.
_REAPER = ("import os, subprocess, sys\n"
           "p = subprocess.Popen(sys.argv[1:])\n"
           "_, status, usage = os.wait4(p.pid, 0)\n"
           f"sys.stderr.write('\\n{_PEAK}%d\\n' % usage.ru_maxrss)\n"
           "sys.exit(os.waitstatus_to_exitcode(status))\n")


def find() -> LlamaCpp | None:
    """The llama.cpp build named by $GLMCORE_LLAMACPP, or None when unset. A set but unusable path is an error
    (the user asked for the comparison)."""
    root = os.environ.get(ENV)
    if not root:
        return None
    lc = LlamaCpp(Path(root))
    missing = [str(p) for p in [lc.root / "convert_hf_to_gguf.py", *(lc.tool(t) for t in TARGETS)] if not p.exists()]
    if missing:
        raise GlmcoreError(f"${ENV}={root} is not a built llama.cpp tree (missing {missing[0]}); build it with "
                           "`python -m glmcore_conformance.llamacpp build SDIST --dir DIR` or unset it")
    return lc


def _run(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise GlmcoreError(f"llama.cpp {what} failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-500:]}")


# ---------------------------------------------------------------- building llama.cpp from the sdist

def build(sdist: Path, dest: Path, jobs: int = 2) -> Path:
    """Extract llama-cpp-python's source distribution into dest and build llama-bench and llama-quantize of
    the llama.cpp it vendors, for this CPU (GGML_NATIVE), at the lowest CPU priority. Returns the tree."""
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        tar.extractall(dest, filter="data")
    root = Path(dest) / top / "vendor" / "llama.cpp"
    if not (root / "CMakeLists.txt").is_file():
        raise GlmcoreError(f"{sdist}: no vendor/llama.cpp inside; pass llama-cpp-python's source distribution")
    build_targets(root, TARGETS, jobs)
    return root


def build_targets(root: Path, targets, jobs: int = 2, timeout: float | None = None) -> None:
    """Configure the tree (this CPU, no curl/OpenSSL, the server's target defined but its web UI neither built
    nor downloaded: nothing is fetched) and build `targets` at the lowest CPU priority, within `timeout` s."""
    nice = ["nice", "-n", "19"] if sys.platform != "win32" else []
    steps = [["cmake", "-S", str(root), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
              "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"],
             ["cmake", "--build", str(root / "build"), "--target", *targets, "-j", str(jobs)]]
    for step in steps:
        try:
            r = subprocess.run([*nice, *step], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise GlmcoreError(f"building llama.cpp's {', '.join(targets)} took over {timeout:g} s; build it once by "
                               f"hand: {' '.join(step)}") from None
        if r.returncode:
            raise GlmcoreError(f"building llama.cpp's {', '.join(targets)} failed (exit {r.returncode}): "
                               f"{(r.stderr or r.stdout).strip()[-500:]}")


# ---------------------------------------------------------------- llama-server, for its chat templates

class LlamaServer:
    """llama-server on one GGUF, on 127.0.0.1 only, for its endpoints that run no model (/apply-template renders
    the chat template as its chat completions do; /tokenize): `with LlamaServer(lc, gguf) as s: s.post(...)`.
    Start-up is polled a bounded number of times; the process is killed on exit."""

    def __init__(self, lc: LlamaCpp, gguf: Path, args=(), start_s: float = 120):
        self.cmd = [str(lc.tool("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", "0",
                    "-c", "512", "-t", "1", "-np", "1", "--no-warmup", "--no-webui", *args]
        self.start_s = start_s

    def __enter__(self) -> "LlamaServer":
        import socket
        import time
        with socket.socket() as s:          # a free port on the loopback (llama-server takes no port 0)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.cmd[self.cmd.index("--port") + 1] = str(port)
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + self.start_s
        for _ in range(int(self.start_s * 4)):
            if self.proc.poll() is not None:
                self._fail(f"exited ({self.proc.returncode}) on start")
            try:
                self.get("/health")
                return self
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.25)
        self._fail(f"did not answer /health within {self.start_s:g} s")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()

    def _fail(self, why: str):
        self.log.seek(0)
        tail = self.log.read().strip()[-800:]
        self.__exit__()
        raise GlmcoreError(f"llama-server {why}: {tail}")

    @staticmethod
    def _open(req, timeout: float):
        import urllib.request
        # straight to the loopback: an http_proxy in the environment is not asked
        return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=timeout)

    def get(self, path: str) -> dict:
        with self._open(self.url + path, 10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> dict:
        import urllib.error
        import urllib.request
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with self._open(req, 60) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise GlmcoreError(f"llama-server {path} answered {e.code}: {e.read().decode(errors='replace')[:300]}") \
                from None

    def apply_template(self, messages: list[dict], tools=None, **kwargs) -> str:
        """The prompt text llama-server's chat completions would feed the model (its /apply-template)."""
        body = {"messages": messages, **({"tools": tools} if tools else {}), **kwargs}
        return self.post("/apply-template", body)["prompt"]

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """The ids of a rendered prompt as llama-server feeds them: special tokens parsed, BOS added where the
        vocabulary asks for one."""
        return self.post("/tokenize", {"content": text, "add_special": add_special, "parse_special": True})["tokens"]


# ---------------------------------------------------------------- the converter, with our vocabulary

def convert(root: Path, model_dir: Path, out: Path, outtype: str = "f16") -> None:
    """Run llama.cpp's convert_hf_to_gguf.py on a checkpoint. A ChatGLM2/3 or GLM-4 (chatglm layout) one has its
    vocabulary read by our own tokenizer code instead of the checkpoint's remote code: ChatGLM2/3's SentencePiece
    pieces with the special tokens numbered after them, GLM-4's byte-level BPE ranks (tiktoken file) as llama.cpp
    writes a tiktoken vocabulary (token strings and merges as for Qwen), then its 14 special tokens. The
    tokenizer.json checkpoints (GLM-4-0414, the MoE GLMs) keep the converter's own vocabulary code, told the
    pre-tokenizer it names GLM-4-0414's, GLM-4.5's and GLM-4.7-Flash's ("glm4": it recognises a vocabulary by the
    hash of its output, and a synthetic vocabulary is none it knows). An MoE GLM's NextN layer is left out
    (llama.cpp's decode does not run it; the comparison is of the decoder)."""
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    import convert_hf_to_gguf
    from conversion.base import TextModel
    from conversion.chatglm import ChatGLMModel

    from glmcore.config import ModelConfig

    family = ModelConfig.from_dir(model_dir).family
    ChatGLMModel.set_vocab = _glm4_vocab if family == "glm4" else _sentencepiece_vocab
    TextModel.get_vocab_base_pre = lambda self, tokenizer: "glm4"
    extra = ["--no-mtp"] if family in ("glm4-moe", "glm4-moe-lite") else []
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outtype", outtype, "--outfile", str(out), *extra]
    convert_hf_to_gguf.main()


def _sentencepiece_vocab(self) -> None:
    import gguf
    import sentencepiece as spm
    from conversion.base import SentencePieceTokenTypes as Kind

    from glmcore.config import ModelConfig
    from glmcore.tokenizer import SP_SPECIALS

    sp = spm.SentencePieceProcessor(model_file=str(Path(self.dir_model) / "tokenizer.model"))
    specials = SP_SPECIALS[ModelConfig.from_dir(self.dir_model).family]
    tokens, scores, kinds = [], [], []
    for i in range(self.hparams["padded_vocab_size"]):
        if i < sp.vocab_size():
            piece, score = {0: "<unk>", 1: "<bos>", 2: "<eos>"}.get(i, sp.id_to_piece(i)), sp.get_score(i)
            kind = (Kind.UNKNOWN if sp.is_unknown(i) else Kind.CONTROL if sp.is_control(i) else
                    Kind.UNUSED if sp.is_unused(i) else Kind.BYTE if sp.is_byte(i) else Kind.NORMAL)
        elif i - sp.vocab_size() < len(specials):
            piece, score, kind = specials[i - sp.vocab_size()], 0.0, Kind.CONTROL
        else:
            piece, score, kind = f"[PAD{i}]", 0.0, Kind.UNUSED
        tokens.append(piece.encode())
        scores.append(score)
        kinds.append(kind)
    self.gguf_writer.add_tokenizer_model("llama")
    self.gguf_writer.add_tokenizer_pre("chatglm-spm")
    self.gguf_writer.add_token_list(tokens)
    self.gguf_writer.add_token_scores(scores)
    self.gguf_writer.add_token_types(kinds)
    gguf.SpecialVocab(self.dir_model, n_vocab=len(tokens)).add_to_gguf(self.gguf_writer)


def _glm4_vocab(self) -> None:
    import gguf
    from conversion.qwen import QwenModel

    from glmcore.tokenizer import read_rank_file
    from glmcore.vocabulary import GLM4_SPECIALS

    ranks = read_rank_file(Path(self.dir_model) / "tokenizer.model")
    text = QwenModel.token_bytes_to_string
    by_id = {rank: text(token) for token, rank in ranks.items()}
    merges = [" ".join(map(text, QwenModel.bpe(ranks, token, max_rank=rank)))
              for token, rank in ranks.items() if len(token) > 1]
    special = {len(ranks) + i: name for i, name in enumerate(GLM4_SPECIALS)}
    tokens, kinds = [], []
    for i in range(self.hparams["padded_vocab_size"]):
        if i in by_id:
            tokens.append(by_id[i])
            kinds.append(gguf.TokenType.NORMAL)
        elif i in special:
            tokens.append(special[i])
            kinds.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(f"[PAD{i}]")
            kinds.append(gguf.TokenType.UNUSED)
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("chatglm-bpe")
    self.gguf_writer.add_token_list(tokens)
    self.gguf_writer.add_token_types(kinds)
    vocab = gguf.SpecialVocab(self.dir_model, load_merges=False, n_vocab=len(tokens))
    vocab.merges = merges
    ids = {name: i for i, name in special.items()}
    vocab._set_special_token("eos", ids["<|endoftext|>"])
    vocab._set_special_token("eot", ids["<|user|>"])
    vocab._set_special_token("unk", ids["<|endoftext|>"])
    vocab.add_to_gguf(self.gguf_writer)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glmcore_conformance.llamacpp", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build llama-bench and llama-quantize from llama-cpp-python's sdist")
    b.add_argument("sdist", type=Path)
    b.add_argument("--dir", type=Path, required=True)
    b.add_argument("-j", "--jobs", type=int, default=2)
    c = sub.add_parser("convert", help=argparse.SUPPRESS)
    c.add_argument("root", type=Path)
    c.add_argument("model", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--outtype", default="f16")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        print(f"export {ENV}={build(a.sdist, a.dir, a.jobs)}")
    else:
        convert(a.root, a.model, a.out, a.outtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
