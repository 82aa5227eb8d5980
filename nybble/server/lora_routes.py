"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's routes, served
only with ``--allow-runtime-lora-updating`` or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``).

Loading checks the folder against the base before any request can name it (a bad folder is a
400 and the server goes on); unloading stops new requests from naming the adapter, while
requests already running under it finish. Both answer 200 with a plain-text line, as vLLM.
"""
from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from nybble.errors import InvalidRequestError
from nybble.server.auth import require_api_key
from nybble.server.openapi import error_responses
from nybble.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from nybble.server.lora_registry import LoRARegistry
from nybble.server.state import ServerState, get_state, run_blocking, wait_ready

logger = logging.getLogger(__name__)
router = APIRouter(dependencies=[Depends(require_api_key), Depends(wait_ready)],
                   responses=error_responses(400, 401, 404, 500, 503))


def _registry(state: ServerState) -> LoRARegistry:
    if state.lora is None:
        raise InvalidRequestError("LoRA adapters need a server started with --enable-lora",
                                  param="lora_name")
    return state.lora


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(req: LoadLoRAAdapterRequest, request: Request) -> str:
    """Serve the PEFT adapter folder ``lora_path`` as the model ``lora_name``.

    Raises:
        InvalidRequestError: LoRA is off, the name is in use (400).
        LoRAAdapterError: the folder cannot be served on this base (400).
    """
    state = get_state(request)
    registry = _registry(state)
    # NOTE: reading the config and the weights' header is file I/O: off the event loop
    await run_blocking(state, registry.check, req.lora_name, req.lora_path,
                       req.base_model_name)
    lora = registry.add(req.lora_name, req.lora_path, req.base_model_name)
    logger.info("LoRA adapter %s loaded from %s (id %d)", lora.lora_name, lora.lora_path,
                lora.lora_int_id)
    return f"Success: LoRA adapter '{req.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, request: Request) -> str:
    """Stop serving the adapter ``lora_name`` (running requests finish under it).

    Raises:
        ModelNotFoundError: no adapter of that name (404).
    """
    state = get_state(request)
    lora = _registry(state).remove(req.lora_name)
    logger.info("LoRA adapter %s unloaded (id %d)", lora.lora_name, lora.lora_int_id)
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
