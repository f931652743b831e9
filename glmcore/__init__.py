"""glmcore: run the GLM chat models (ChatGLM2/3, GLM-4) on any hardware through backend plugins."""
from .offline import block_telemetry

block_telemetry()       # first: before any plugin imports a runtime
from .backend import (Backend, BatchSession, Capabilities, LoadOptions, Probe, Session, SessionAdapter, hookimpl,
                      registry)
from .config import ModelConfig
from .errors import (BackendError, CheckpointError, ConfigError, ContextOverflow, GlmcoreError,
                     SamplingError)
from .model import load_model
from .scheduler import Request, Scheduler, Timings, WindowPolicy
from .sampling import Sampler, SamplingParams
from .weights import Weights, load_weights

__version__ = "0.1.0"
__all__ = ["Backend", "BackendError", "BatchSession", "Capabilities", "CheckpointError", "ConfigError", "ContextOverflow",
           "GlmcoreError", "LoadOptions", "ModelConfig", "Pipeline", "Probe", "Request", "Sampler", "SamplingError",
           "SamplingParams", "Scheduler", "Session", "SessionAdapter", "Timings", "Weights", "WindowPolicy", "hookimpl", "load_model",
           "load_weights", "registry"]


def __getattr__(name):   # Pipeline pulls in the tokenizer and chat modules; import on first use
    if name == "Pipeline":
        from .pipeline import Pipeline
        return Pipeline
    raise AttributeError(name)
