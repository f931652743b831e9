"""The TPU-MLIR step: a bash script that compiles the exported ONNX parts into one BM1684X bmodel.

Per part: model_transform.py (ONNX -> top MLIR), then model_deploy.py --chip bm1684x with the chosen
--quantize, RMSNorm kept in F32 (a quantize table listing its ops, plus --high_precision on TPU-MLIR
versions that have it), --quant_input/--quant_output so the runtime exchanges F16 tensors between
parts without casts; finally model_tool --combine joins the parts into one bmodel, as the Sophgo
ChatGLM deployments do.
"""
from __future__ import annotations

import importlib.util
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


def write_qtables(manifest: dict, out: Path) -> None:
    qdir = out / "qtable"
    qdir.mkdir(parents=True, exist_ok=True)
    for part in manifest["parts"]:
        lines = ["# TPU-MLIR quantize table: keep RMSNorm in F32 (op name, mode)"]
        lines += [f"{name} F32" for name in part["f32_ops"]]
        (qdir / f"{part['name']}.qtable").write_text("\n".join(lines) + "\n")


def write_script(manifest: dict, out: Path, family: str, quantize: str, group_size: int = 64) -> Path:
    seq_len = manifest["key"]["seq_len"]
    layers = sorted({p["layer"] for p in manifest["parts"] if "layer" in p})
    order = ["embedding", "embedding_cache"] + [f"{k}_{i}" for i in layers for k in ("block", "block_cache")] \
        + ["lm_head", "lm_head_top1"]
    combine = " \\\n  ".join(f"build/{n}/{n}.bmodel" for n in order)
    script = f"""#!/usr/bin/env bash
# Compile the ONNX parts in onnx/ into one BM1684X bmodel with TPU-MLIR.
# Written by `glmcore convert --backend tpu_bm1684x` ({family}, {len(layers)} layers, SEQ_LEN={seq_len}).
# Run it where TPU-MLIR is installed (pip install tpu_mlir on Python 3.10, or its docker image after
# `source envsetup.sh`). Override the mode with QUANTIZE=F16|BF16|W8F16|W4F16 ./{SCRIPT}
set -euo pipefail
cd "$(dirname "$0")"
QUANTIZE="${{QUANTIZE:-{quantize}}}"
CHIP=bm1684x
OUT="${{OUT:-{family}_${{QUANTIZE,,}}_seq{seq_len}.bmodel}}"
GROUP_ARGS=""
case "$QUANTIZE" in W4*) GROUP_ARGS="--q_group_size {group_size}" ;; esac
# Embedding tables are gathered, not multiplied: weight-only int quantization does not apply.
case "$QUANTIZE" in *BF16) EMBED_QUANT=BF16 ;; *) EMBED_QUANT=F16 ;; esac
# RMSNorm stays F32: its ops are listed in qtable/<part>.qtable; newer TPU-MLIR also wants --high_precision.
HIGH_PRECISION=""
if model_deploy.py --help 2>/dev/null | grep -q -- "--high_precision"; then HIGH_PRECISION="--high_precision"; fi

compile_part() {{  # NAME QUANTIZE [model_deploy.py args...]
  local name=$1 quant=$2
  shift 2
  echo "[tpu_bm1684x] compiling $name ($quant)"
  mkdir -p "build/$name"
  (
    cd "build/$name"
    model_transform.py --model_name "$name" --model_def "../../onnx/$name.onnx" --mlir "$name.mlir"
    model_deploy.py --mlir "$name.mlir" --quantize "$quant" --quantize_table "../../qtable/$name.qtable" \\
      $HIGH_PRECISION --chip "$CHIP" "$@" --model "$name.bmodel"
  )
}}

compile_part embedding "$EMBED_QUANT" --quant_input --quant_output
compile_part embedding_cache "$EMBED_QUANT" --quant_input --quant_output
for i in {' '.join(str(i) for i in layers)}; do
  compile_part "block_$i" "$QUANTIZE" $GROUP_ARGS --quant_input --quant_output
  compile_part "block_cache_$i" "$QUANTIZE" $GROUP_ARGS --quant_input --quant_output
done
# logits leave the device as F32; the top-1 variant returns only the token id
compile_part lm_head "$QUANTIZE" $GROUP_ARGS --quant_input
compile_part lm_head_top1 "$QUANTIZE" $GROUP_ARGS --quant_input

echo "[tpu_bm1684x] combining {len(order)} parts into $OUT"
model_tool --combine \\
  {combine} \\
  -o "$OUT"
echo "[tpu_bm1684x] wrote $OUT"
"""
    path = out / SCRIPT
    path.write_text(script)
    path.chmod(0o755)
    return path


def tpu_mlir_status() -> tuple[bool, str]:
    """Whether TPU-MLIR can run here, and a one-line why not."""
    if importlib.util.find_spec("tpu_mlir") is None:
        return False, "tpu_mlir is not importable (TPU-MLIR needs Python 3.10: pip install tpu_mlir)"
    if shutil.which("model_transform.py") is None or shutil.which("model_deploy.py") is None:
        return False, "tpu_mlir is importable but model_transform.py/model_deploy.py are not on PATH"
    return True, "tpu_mlir importable, model_transform.py on PATH"


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
