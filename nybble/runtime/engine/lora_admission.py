"""Admission of LoRA requests: a request enters the scheduler only once its adapter holds a
pinned device slot, so every step runs at most ``max_loras`` distinct adapters.

A request whose adapter finds every slot pinned by other adapters' running requests waits
here (it is not failed); each step first admits the waiting requests whose adapter now has a
slot, oldest first (a request for an adapter that is already resident passes a waiting one:
it needs no new slot). The pin is dropped when the request's last sequence finishes or is
aborted.
"""
from __future__ import annotations

from collections import OrderedDict, Counter
from collections.abc import Callable

from nybble.runtime.messages import EngineCoreRequest
from nybble.runtime.worker.lora_manager import LoRAManager


class LoRAAdmission:
    """The requests waiting for a slot and the slot each admitted request pins.

    Args:
        manager: the adapters and slots.
        admit: puts a request with its pinned slot into the scheduler (the engine core's
            add); if it raises, the slot is unpinned and the error passes on.
    """

    def __init__(self, manager: LoRAManager,
                 admit: Callable[[EngineCoreRequest, int], None]) -> None:
        self.manager = manager
        self._admit = admit
        self.waiting: OrderedDict[str, EngineCoreRequest] = OrderedDict()
        self.slot_of: dict[str, int] = {}          # admitted request id -> its pinned slot
        self.names: dict[str, str] = {}            # request id -> adapter name (metrics)

    def add(self, request: EngineCoreRequest) -> None:
        """Load (and check) the request's adapter, then admit it now or queue it.

        Raises:
            LoRAAdapterError: the adapter cannot be served; nothing is queued.
        """
        assert request.lora_request is not None
        self.manager.load(request.lora_request)
        self.names[request.request_id] = request.lora_request.lora_name
        if self.waiting or not self._try(request):
            self.waiting[request.request_id] = request
            self.admit_waiting()

    def _try(self, request: EngineCoreRequest) -> bool:
        assert request.lora_request is not None
        slot = self.manager.acquire(request.lora_request)
        if slot is None:
            return False
        try:
            self._admit(request, slot)
        except BaseException:
            self.manager.release(slot)
            raise
        self.slot_of[request.request_id] = slot
        return True

    def admit_waiting(self) -> list[tuple[str, BaseException]]:
        """Admit every waiting request whose adapter can get a slot now (oldest first);
        returns ``(request id, error)`` of those whose admission failed (dropped)."""
        failed = []
        for rid, request in list(self.waiting.items()):
            try:
                admitted = self._try(request)
            except Exception as e:      # NOTE: the adapter could not be read again
                admitted = True
                self.names.pop(rid, None)
                failed.append((rid, e))
            if admitted:
                del self.waiting[rid]
        return failed

    def finished(self, request_id: str) -> None:
        """The request ended (or was aborted): unpin its slot, or drop it from the queue."""
        self.names.pop(request_id, None)
        if self.waiting.pop(request_id, None) is not None:
            return
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.manager.release(slot)

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Requests per adapter name: ``(running, waiting)`` (admitted ones run)."""
        waiting = Counter(self.names[r] for r in self.waiting if r in self.names)
        running = Counter(self.names[r] for r in self.slot_of if r in self.names)
        return dict(running), dict(waiting)
