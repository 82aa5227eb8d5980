"""nybble: a quantization-first LLM inference and serving engine.

Public API (vLLM-compatible names)::

    from nybble import LLM, SamplingParams
    llm = LLM()                       # the bundled stories260k model
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))

    from nybble import LoRARequest    # a PEFT adapter per request (docs/lora.md)
    llm = LLM(enable_lora=True)
    out = llm.generate(["Tom"], lora_request=LoRARequest("sql", 1, "/adapters/sql"))
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nybble.config import DEFAULT_MODEL, EngineConfig
from nybble.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from nybble.sampling_params import BeamSearchParams, SamplingParams
from nybble.version import __version__

__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

if TYPE_CHECKING:
    from nybble.lora_request import LoRARequest
    from nybble.runtime.llm_engine import LLMEngine
    from nybble.runtime.llm import LLM


_LAZY = {"LLM": "nybble.runtime.llm", "LLMEngine": "nybble.runtime.llm_engine",
         "LoRARequest": "nybble.lora_request"}


def __getattr__(name: str) -> Any:
    # NOTE: lazy (PEP 562) so that `import nybble`, the Cython core and the API server process
    # do not pull in torch (nor msgspec, for LoRARequest); importlib keeps import-linter from reading these run-time-only
    # edges as imports of the package itself (tests/test_layers.py checks the real ones).
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nybble' has no attribute {name!r}")
