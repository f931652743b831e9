"""The TPU-MLIR step: a bash script that compiles the exported parts into one BM1684X bmodel.

Per part: model_transform.py (ONNX, or TorchScript .pt for parts too big for one protobuf, -> top
MLIR), then model_deploy.py --chip bm1684x with the chosen --quantize, RMSNorm kept in F32 through a
quantize table with TPU-MLIR's own op names (export.norm_op_names), --quant_input/--quant_output so
the runtime exchanges 16-bit tensors between parts without casts; finally model_tool --combine joins
the parts into one bmodel, as Sophgo's LLM-TPU ChatGLM3/GLM4 compile scripts do.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from glmcore.errors import BackendError

from .spec import QUANTIZE_MODES

SCRIPT = "compile.sh"


def bmodel_name(family: str, quantize: str, seq_len: int) -> str:
    return f"{family}_{quantize.lower()}_seq{seq_len}.bmodel"     # as the script's OUT default names it


def check_quantize(quantize: str | None, default: str) -> str:
    q = (quantize or default).upper()
    if q not in QUANTIZE_MODES:
        raise BackendError(f"unknown --quantize {quantize!r} for tpu_bm1684x; choose one of "
                           f"{', '.join(QUANTIZE_MODES)}")
    return q


def write_qtables(manifest: dict, out: Path, f32_ops: dict | None = None) -> None:
    """One quantize table per part. f32_ops: the op names of parts compiled from TorchScript, whose ops
    TPU-MLIR names differently from the ONNX part's (graphs.torchscript_op_names)."""
    qdir = out / "qtable"
    qdir.mkdir(parents=True, exist_ok=True)
    for part in manifest["parts"]:
        lines = ["# TPU-MLIR quantize table: keep RMSNorm in F32 (op name, mode)"]
        lines += [f"{name} F32" for name in (f32_ops or {}).get(part["name"], part["f32_ops"])]
        (qdir / f"{part['name']}.qtable").write_text("\n".join(lines) + "\n")


TOOLS = {"model_transform": "ONNX/TorchScript -> MLIR", "model_deploy": "MLIR -> bmodel",
         "model_tool": "combines the parts"}


def write_script(manifest: dict, out: Path, family: str, quantize: str, group_size: int = 64,
                 torchscript: frozenset = frozenset()) -> Path:
    """`torchscript`: names of the parts compiled from onnx/<name>.pt instead of .onnx (embedding and
    lm_head when their f32 weights exceed a protobuf; embedding_cache then uses embedding.pt)."""
    seq_len = manifest["key"]["seq_len"]
    hidden = manifest["key"]["config"]["hidden_size"]
    layers = sorted({p["layer"] for p in manifest["parts"] if "layer" in p})
    order = ["embedding", "embedding_cache"] + [f"{k}_{i}" for i in layers for k in ("block", "block_cache")] \
        + ["lm_head", "greedy_head"]
    combine = " \\\n  ".join(f"build/{n}/{n}.bmodel" for n in order)
    pt = {"embedding": f"../../onnx/embedding.pt --input_shapes [[1,{seq_len}]] --input_types int32",
          "embedding_cache": "../../onnx/embedding.pt --input_shapes [[1,1]] --input_types int32",
          "lm_head": f"../../onnx/lm_head.pt --input_shapes [[1,{hidden}]]"}
    model_def = {n: pt[n] if (n == "embedding_cache" and "embedding" in torchscript) or n in torchscript
                 else f"../../onnx/{n}.onnx" for n in order}
    find_tools = "\n".join(f'{t.upper()}=$(command -v {t}.py || command -v {t} || true)' for t in TOOLS)
    script = f"""#!/usr/bin/env bash
# Compile the exported parts in onnx/ into one BM1684X bmodel with TPU-MLIR.
# Written by `glmcore convert --backend tpu_bm1684x` ({family}, {len(layers)} layers, SEQ_LEN={seq_len}).
# Run it where TPU-MLIR is installed (pip install tpu_mlir, or its docker image after
# `source envsetup.sh`). Override the mode with QUANTIZE=F16|BF16|W8F16|W4F16|W8BF16|W4BF16 ./{SCRIPT}
set -euo pipefail
cd "$(dirname "$0")"
QUANTIZE="${{QUANTIZE:-{quantize}}}"
CHIP=bm1684x
OUT="${{OUT:-{family}_${{QUANTIZE,,}}_seq{seq_len}.bmodel}}"
# The tools as a source install puts them on PATH (model_transform.py ...) or as pip registers them.
{find_tools}
for tool in "$MODEL_TRANSFORM:model_transform" "$MODEL_DEPLOY:model_deploy" "$MODEL_TOOL:model_tool"; do
  if [ -z "${{tool%%:*}}" ]; then echo "[tpu_bm1684x] ${{tool#*:}}(.py) not found on PATH: install TPU-MLIR" >&2; exit 2; fi
done
# Weight-only modes quantize per group of {group_size} input channels. TPU-MLIR applies --q_group_size to
# W4F16/W4BF16, and newer versions to W8F16/W8BF16 too (default 64 there as well); older ones ignore it
# for W8 (per-channel). Passing it for both keeps the choice explicit on either.
GROUP_ARGS=""
case "$QUANTIZE" in W4*|W8*) GROUP_ARGS="--q_group_size {group_size}" ;; esac
# Embedding tables are gathered, not multiplied: weight-only int quantization does not apply.
case "$QUANTIZE" in *BF16) EMBED_QUANT=BF16 ;; *) EMBED_QUANT=F16 ;; esac
# RMSNorm stays F32 through qtable/<part>.qtable (TPU-MLIR op names). Newer TPU-MLIR also takes
# --high_precision (Softmax/AvgPool in F32); older versions keep such ops in F32 by default and have
# --ignore_f16_overflow to turn that off, which is never passed here (the newest ones reject it).
HIGH_PRECISION=""
if "$MODEL_DEPLOY" --help 2>/dev/null | grep -- "--high_precision" >/dev/null; then HIGH_PRECISION="--high_precision"; fi

compile_part() {{  # NAME MODEL_DEF QUANTIZE [model_deploy args...]
  local name=$1 def=$2 quant=$3
  shift 3
  echo "[tpu_bm1684x] compiling $name ($quant)"
  mkdir -p "build/$name"
  (
    cd "build/$name"
    # shellcheck disable=SC2086  # def carries --input_shapes/--input_types for .pt parts
    "$MODEL_TRANSFORM" --model_name "$name" --model_def $def --mlir "$name.mlir"
    "$MODEL_DEPLOY" --mlir "$name.mlir" --quantize "$quant" --quantize_table "../../qtable/$name.qtable" \\
      $HIGH_PRECISION --chip "$CHIP" "$@" --model "$name.bmodel"
  )
}}

compile_part embedding "{model_def['embedding']}" "$EMBED_QUANT" --quant_input --quant_output
compile_part embedding_cache "{model_def['embedding_cache']}" "$EMBED_QUANT" --quant_input --quant_output
for i in {' '.join(str(i) for i in layers)}; do
  compile_part "block_$i" "../../onnx/block_$i.onnx" "$QUANTIZE" $GROUP_ARGS --quant_input --quant_output
  compile_part "block_cache_$i" "../../onnx/block_cache_$i.onnx" "$QUANTIZE" $GROUP_ARGS --quant_input --quant_output
done
# logits leave the device as F32; greedy_head (TopK, no weights) picks the token on the device
compile_part lm_head "{model_def['lm_head']}" "$QUANTIZE" $GROUP_ARGS --quant_input
compile_part greedy_head "{model_def['greedy_head']}" F32

echo "[tpu_bm1684x] combining {len(order)} parts into $OUT"
"$MODEL_TOOL" --combine \\
  {combine} \\
  -o "$OUT"
echo "[tpu_bm1684x] wrote $OUT"
"""
    path = out / SCRIPT
    path.write_text(script)
    path.chmod(0o755)
    return path


def tpu_mlir_status() -> tuple[bool, str]:
    """Whether TPU-MLIR's commands can run here, and a one-line why not. A pip install registers them
    (with or without .py), a source or docker install puts model_transform.py etc. on PATH after
    `source envsetup.sh` without an importable package: each command is looked up either way."""
    found = {t: shutil.which(f"{t}.py") or shutil.which(t) for t in TOOLS}
    missing = [f"{t} ({why})" for t, why in TOOLS.items() if not found[t]]
    if missing:
        return False, (f"TPU-MLIR commands not on PATH: {', '.join(missing)}; pip install tpu_mlir (Python 3.10) "
                       "or `source envsetup.sh` in its docker image")
    return True, "TPU-MLIR commands on PATH: " + ", ".join(Path(p).name for p in found.values())


def run_script(out: Path, quantize: str, progress) -> Path:
    """Run compile.sh, streaming its per-part lines to progress; the full log goes to compile.log."""
    log = out / "compile.log"
    env_cmd = ["env", f"QUANTIZE={quantize}", "bash", SCRIPT]
    with open(log, "w") as f, subprocess.Popen(env_cmd, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               text=True) as p:
        for line in p.stdout:
            f.write(line)
            if line.startswith("[tpu_bm1684x]"):
                progress(line.rstrip()[len("[tpu_bm1684x] "):])
    if p.returncode != 0:
        raise BackendError(f"TPU-MLIR compile failed (exit {p.returncode}); see {log}")
    return log
