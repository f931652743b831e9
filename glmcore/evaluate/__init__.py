"""`glmcore eval`: perplexity as llama-perplexity computes it, the quantization-quality table across
backends (perplexity, KL divergence from the torch reference, top-1 agreement), and the
lm-evaluation-harness model "glmcore".

Importing this package registers "glmcore" in lm_eval's model registry (lazily: lm_eval is imported
only when the harness asks for the model), so `lm_eval.simple_evaluate(model="glmcore", ...)` works
after `import glmcore.evaluate`. Without lm-eval installed everything but the harness works.
"""
from __future__ import annotations

import importlib.util

from .perplexity import Result, Spec, measure, parse_specs, ppl_and_error, table, windows
from .scoring import Scorer, log_softmax, run_slots

HARNESS_MODEL = "glmcore"
HARNESS_TARGET = "glmcore.evaluate.harness:GlmcoreLM"
INSTALL = 'pip install "glmcore[eval]"'


def register_harness_model() -> bool:
    """Register "glmcore" in lm_eval's model registry; False when lm-eval is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        return False
    from lm_eval.api.registry import model_registry
    if HARNESS_MODEL not in model_registry:      # once the harness loaded it, the entry is the class itself
        model_registry.register(HARNESS_MODEL, target=HARNESS_TARGET)
    return True


register_harness_model()

__all__ = ["HARNESS_MODEL", "Result", "Scorer", "Spec", "log_softmax", "measure", "parse_specs", "ppl_and_error",
           "register_harness_model", "run_slots", "table", "windows"]
