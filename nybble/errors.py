"""Exception hierarchy for nybble.

User errors derive from :class:`ValueError` so that callers that already catch ``ValueError``
keep working; the server maps :class:`InvalidRequestError` to HTTP 400 and
:class:`ModelNotFoundError` to HTTP 404.
"""
from __future__ import annotations


class NybbleError(Exception):
    """Base class of every error nybble raises on purpose."""


class InvalidRequestError(NybbleError, ValueError):
    """A request parameter is outside its allowed range (HTTP 400).

    Args:
        message: what was wrong and what is allowed.
        param: the offending parameter's name, echoed in the OpenAI error body.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(NybbleError, ValueError):
    """The request names a model this server does not serve (HTTP 404)."""


class UnsupportedModelError(NybbleError, ValueError):
    """The checkpoint's architecture, dtype or quantization format is not supported."""


class KVCacheExhaustedError(InvalidRequestError):
    """A single request needs more KV blocks than the whole pool holds."""


class EngineStepError(NybbleError):
    """An engine step raised; the requests of its batch were failed and rolled back.

    The engine core aborted those requests (their sequences finished, KV blocks freed,
    sampling rows dropped) before raising, so the engine keeps serving the others.

    Args:
        request_ids: the requests that were in the failed step's batch.
        message: one line saying what failed.
    """

    def __init__(self, request_ids: list[str], message: str) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class WorkerFailedError(NybbleError, RuntimeError):
    """A tensor-parallel worker (rank 1..N-1) died or stopped answering: the engine cannot
    step again (the engine-core process reports itself dead, ``/health`` answers 503)."""


class EngineStartupError(NybbleError):
    """The engine core could not start (its one-line reason; a bad folder or flag)."""


class EngineDeadError(NybbleError):
    """The engine core is gone (it exited, or can no longer step): HTTP 503."""


class EngineShutdownError(NybbleError):
    """The server is shutting down: HTTP 503."""


class EngineRequestError(NybbleError):
    """The engine core failed this request (a failed step): HTTP 500."""


class EngineOverloadedError(NybbleError):
    """Too many requests wait for the engine (admission control): HTTP 503, retry later.

    Attributes:
        retry_after_s: a hint for the ``Retry-After`` header (seconds).
    """

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter folder this engine cannot serve (HTTP 400): not a PEFT LoRA folder, a
    kind of adapter nybble does not run (DoRA, embeddings, ``modules_to_save``...), or weights
    of another base model. The message says what was wrong and what is allowed."""
