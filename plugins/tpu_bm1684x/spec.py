"""Constants shared by the exporter, the runtimes and the compile script (no heavy imports)."""
from __future__ import annotations

# Additive attention mask for masked slots. The Sophgo deployments use -10000 (0xF0E2 in fp16, exact
# in fp16 and bf16-representable to within 16). After the max subtraction of softmax every masked
# logit is <= -10000 + (score spread), and exp() of that underflows to exactly 0.0 in fp32, so masked
# slots contribute exactly nothing; unlike -inf it never makes a fully masked row (the padding rows
# of a short prompt) NaN. The tests check the exactness.
MASK_VALUE = -10000.0

DEFAULT_SEQ_LEN = 512
TORCH_OPSET = 15              # what the Sophgo exports and TPU-MLIR's ONNX front end are tested with
FORMAT_VERSION = 1            # bump when the graphs change: old exported parts are then not reused
QUANTIZE_MODES = ("F16", "BF16", "W8F16", "W4F16")
DEFAULT_QUANTIZE = "W8F16"
