"""Errors the user can act on. Each message is one line naming the problem and the fix."""


class GlmcoreError(Exception):
    """Base of every user-facing error; the CLI prints it as one line and exits 2."""


class ConfigError(GlmcoreError):
    pass


class CheckpointError(GlmcoreError):
    pass


class BackendError(GlmcoreError):
    pass


class SamplingError(GlmcoreError, ValueError):
    pass


class ContextOverflow(GlmcoreError):
    """A sequence would outgrow the session's KV capacity under the `error` policy."""
