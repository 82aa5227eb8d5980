"""LoRARequest: which LoRA adapter a request runs under (vLLM's ``vllm.lora.request`` shape).

``LLM.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/path/to/adapter"))``; the
server builds one per adapter it serves (``--lora-modules``, ``/v1/load_lora_adapter``) and a
request picks it by its ``model`` field.
"""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    """A LoRA adapter by name, id and folder.

    Attributes:
        lora_name: the name clients use (the ``model`` of an API request).
        lora_int_id: a positive integer naming the adapter inside the engine: two requests with
            the same id share its loaded weights, its device slot and its prefix-cache blocks,
            so one id must always mean one folder.
        lora_path: a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``,
            as ``PeftModel.save_pretrained`` writes them).
        base_model_name: the served model it adapts (``/v1/models`` reports it as ``parent``;
            default: the base model's served name).

    Raises (on construction):
        ValueError: ``lora_int_id`` < 1 or an empty name or path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name or not self.lora_path:
            raise ValueError(f"lora_name and lora_path must be non-empty, got "
                             f"{self.lora_name!r} and {self.lora_path!r}")

    @property
    def cache_salt(self) -> int:
        """The root of this adapter's prefix-cache hash chain (never 0, the base's): a 64-bit
        mix of ``lora_int_id`` (splitmix64's finalizer), so adapters never share KV blocks."""
        z = (self.lora_int_id * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return (z ^ (z >> 31)) or 1
