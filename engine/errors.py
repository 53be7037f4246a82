"""Exceptions raised by the engine.

Hierarchy::

    EngineError
    ├── ModelLoadError            a weight file is missing, corrupt or does not fit the config
    │   └── UnsupportedModelError the architecture or one of its options is not implemented
    ├── InvalidRequestError       bad prompt / sampling parameters (maps to HTTP 400)
    ├── EngineOverloadedError     the waiting queue is full (maps to HTTP 429)
    └── ParallelConfigError       a tensor-parallel size the model's heads do not divide (also a ValueError)
"""


class EngineError(Exception):
    """Base class of every engine error."""


class ModelLoadError(EngineError):
    """A model file is missing, corrupt, or its tensors do not match the config."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture or an option of it is not supported."""


class InvalidRequestError(EngineError, ValueError):
    """A request's prompt or sampling parameters are invalid."""


class EngineOverloadedError(EngineError):
    """The engine cannot admit more requests right now."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ParallelConfigError(EngineError, ValueError):
    """A tensor-parallel layout this model or machine cannot run (e.g. N does not divide the heads)."""
