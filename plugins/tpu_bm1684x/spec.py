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
FORMAT_VERSION = 2            # bump when the graphs change: old exported parts are then not reused
# TPU-MLIR model_deploy.py --quantize modes offered. The F16 family suits ChatGLM2/3 (Sophgo's own
# ChatGLM3 deployments use W4F16/W8F16/F16); GLM-4's activations overflow f16 more easily and
# LLM-TPU compiles GLM4 in the BF16 family (models/GLM4/compile/compile.sh: W4BF16 with
# --q_group_size 64, W8BF16, BF16), so GLM-4 defaults to BF16.
QUANTIZE_MODES = ("F16", "BF16", "W8F16", "W4F16", "W8BF16", "W4BF16")
DEFAULT_QUANTIZE = {"glm4": "W8BF16"}
DEFAULT_QUANTIZE_OTHER = "W8F16"
# A protobuf (one .onnx file with its weights inline, or what TPU-MLIR's ONNX loader builds in memory
# after onnx.load pulls external data back in) cannot exceed 2 GiB. Parts whose f32 weights reach this
# go to TPU-MLIR as TorchScript .pt instead, as LLM-TPU does for GLM4's embedding and lm_head.
PROTOBUF_LIMIT = 2 ** 31


def default_quantize(family: str) -> str:
    return DEFAULT_QUANTIZE.get(family, DEFAULT_QUANTIZE_OTHER)


# Every part's inputs and outputs in graph order. The device runtime addresses a bmodel's tensors by
# these positions (get_input_names(graph)[i]), as sophon-demo and LLM-TPU do: TPU-MLIR keeps ONNX
# parts' names but names a TorchScript part's tensors by the traced graph's debugName() ("x.1", "20").
_IO = {"embedding": (("input_ids",), ("input_embed",)),
       "block": (("input_states", "position_ids", "attention_mask"), ("hidden_states", "past_k", "past_v")),
       "block_cache": (("input_states", "position_ids", "attention_mask", "history_k", "history_v"),
                       ("hidden_states", "present_k", "present_v")),
       "lm_head": (("hidden_states",), ("logits",)),
       "greedy_head": (("m_logits",), ("token",))}


def io_names(graph: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(input names, output names) of a part in graph order, as part_specs declares them."""
    kind = graph.rstrip("0123456789").rstrip("_") if graph[-1:].isdigit() else graph
    return _IO["embedding" if kind == "embedding_cache" else kind]
