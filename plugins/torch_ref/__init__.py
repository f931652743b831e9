"""Backend `torch`: the PyTorch reference, the plainest fp32 statement of the GLM math.

Every other backend is held to this one by the conformance suite, and this one is held to
transformers' GlmForCausalLM in the tests. Clarity over speed: no fusion, no tricks.
"""
from __future__ import annotations

import importlib.util

from glmcore import arch
from glmcore.backend import Backend, Capabilities, LoadOptions, Probe, describe, hookimpl

# The architectures forward.py has a torch forward for (its FORWARDS keys), named here so that
# supports() answers without importing torch.
TORCH_FORWARDS = ("glm", "glm4_moe", "glm4_moe_lite")


def torch_forward_runs(backend: Backend, config) -> str | None:
    """supports() of a backend that runs the shared torch forward (torch, ascend_npu)."""
    if arch.of(config).torch_forward in TORCH_FORWARDS:
        return None
    return f"the shared torch forward (plugins/torch_ref) has no block for {describe(config)}"


def torch_forward_architectures() -> list[str]:
    return [a.describe() for a in arch.architectures() if a.torch_forward in TORCH_FORWARDS]


class TorchBackend(Backend):
    name = "torch"
    option_keys = ()        # no backend-specific options
    extra = "torch"
    description = "PyTorch fp32 reference (CPU)"

    def probe(self) -> Probe:
        if importlib.util.find_spec("torch") is None:
            return Probe(False, reason="torch is not installed", install=self.install_hint())
        import torch
        return Probe(True, device="cpu", details={"torch": torch.__version__, "threads": torch.get_num_threads(),
                                                  "runs on": "this machine's CPU"})

    def capabilities(self) -> Capabilities:
        return Capabilities(precisions=("f32",), weight_formats=("f32",), speed_rank=0, native_batch=True,
                            kv_export=True)

    def supports(self, config) -> str | None:
        return torch_forward_runs(self, config)

    def architectures(self) -> list[str]:
        return torch_forward_architectures()

    def load(self, config, weights, options: LoadOptions):
        from .model import TorchRefSession
        return TorchRefSession(config, weights, options, self.capabilities())

    def load_batch(self, config, weights, options: LoadOptions, n_slots: int):
        from .model import TorchRefBatch
        return TorchRefBatch(config, weights, options, self.capabilities(), n_slots)

    def load_shard(self, shard, options: LoadOptions, n_slots: int):
        """This rank's part of the model under tensor parallelism (glmcore/parallel.py)."""
        from .model import TorchRefBatch
        return TorchRefBatch(shard.config, shard.weights, options, self.capabilities(), n_slots, tp=shard)


@hookimpl
def glmcore_backends():
    return [TorchBackend()]
