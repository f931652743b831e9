"""Errors the user can act on. Each message is one line naming the problem and the fix.

Every exception glmcore raises for bad input (a file, an option, a message) is a GlmcoreError; the
CLI prints it as `error: ...` and exits 2. Any other exception is a bug in glmcore.
"""


class GlmcoreError(Exception):
    """Base of every user-facing error; the CLI prints it as one line and exits 2."""


class ConfigError(GlmcoreError):
    pass


class CheckpointError(GlmcoreError):
    pass


class BackendError(GlmcoreError):
    pass


class TokenizerError(GlmcoreError, ValueError):
    """A tokenizer file is missing, corrupt or of the wrong family; the message names the fix."""


class ChatError(GlmcoreError, ValueError):
    """Messages or tools that the model's chat format cannot express."""


class SamplingError(GlmcoreError, ValueError):
    pass


class ContextOverflow(GlmcoreError):
    """A sequence would outgrow the session's KV capacity under the `error` policy."""


class StepError(BackendError):
    """A BatchSession step whose entries break the contract (no such slot, a slot twice, no ids, past
    capacity): the core checks every step's entries once, before the backend sees them."""
