"""nybble: a quantization-first LLM inference and serving engine.

Public API (vLLM-compatible names)::

    from nybble import LLM, SamplingParams
    llm = LLM()                       # the bundled stories260k model
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nybble.config import DEFAULT_MODEL, EngineConfig
from nybble.outputs import CompletionOutput, RequestOutput
from nybble.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

if TYPE_CHECKING:
    from nybble.runtime.engine import LLMEngine
    from nybble.runtime.llm import LLM


def __getattr__(name: str) -> Any:
    # NOTE: lazy so that `import nybble` (and the Cython runtime) does not pull in torch.
    if name == "LLM":
        from nybble.runtime.llm import LLM

        return LLM
    if name == "LLMEngine":
        from nybble.runtime.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'nybble' has no attribute {name!r}")
