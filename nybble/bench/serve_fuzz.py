"""Schema-conformance fuzzing of a running ``nybble serve`` with schemathesis.

Requests are generated from the server's own ``/openapi.json`` (every route, every method):
for each operation ``examples`` cases that follow the schema (positive) and as many that break
it (negative: wrong types, missing fields, out-of-schema values). Each case is sent (several
at a time, over keep-alive connections) and its answer checked with schemathesis's checks:

- ``not_a_server_error``: no 5xx;
- ``status_code_conformance``, ``content_type_conformance``,
  ``response_headers_conformance``, ``response_schema_conformance``: the answer is one the
  schema documents, with the body it documents;
- ``negative_data_rejection``: a request that breaks the schema is refused with a 4xx.

A request whose connection fails (reset, closed without an answer) is a dropped connection.
``positive_data_acceptance`` is not checked: the schema gives types and shapes, the request
gate checks ranges (``max_tokens`` against the context, ...), so a well-typed request may
still be a 400.

Needs schemathesis (a test dependency). Loopback servers only; the number of requests is
bounded by ``examples``.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

CHECK_NAMES = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
               "response_headers_conformance", "response_schema_conformance",
               "negative_data_rejection")


@dataclass
class FuzzResult:
    """What one :func:`fuzz` run saw."""

    requests: int = 0
    by_operation: Counter[str] = field(default_factory=Counter)
    by_status: Counter[str] = field(default_factory=Counter)
    server_errors: int = 0
    dropped: list[str] = field(default_factory=list)
    violations: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (at most 20 failure examples)."""
        return {"requests": self.requests, "by_operation": dict(self.by_operation),
                "by_status": dict(self.by_status), "server_errors": self.server_errors,
                "dropped_connections": len(self.dropped), "dropped": self.dropped[:10],
                "schema_violations": sum(self.violations.values()),
                "violations": dict(self.violations), "examples": self.examples[:20],
                "duration_s": self.duration_s}


def _cases(operation: Any, mode: Any, examples: int, seed: int) -> list[Any]:
    """``examples`` cases of ``operation`` drawn by hypothesis (generation only; none when
    the mode cannot apply, such as a request that breaks the schema of a route that takes
    no input)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis.errors import Unsatisfiable

    cases: list[Any] = []

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def draw(case: Any) -> None:
        cases.append(case)

    try:
        draw()
    except Unsatisfiable:
        return []
    return cases


def _checks() -> list[Any]:
    import schemathesis.checks as core
    import schemathesis.specs.openapi.checks as openapi

    return [getattr(openapi, n, None) or getattr(core, n) for n in CHECK_NAMES]


def fuzz(base_url: str, examples: int = 600, api_key: str | None = None, workers: int = 8,
         seed: int = 0, timeout_s: float = 120.0) -> FuzzResult:
    """Fuzz every operation of the server at ``base_url`` (see the module's docstring).

    Args:
        examples: positive and again negative cases per operation.
        workers: requests in flight at once.
    """
    import requests
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(base_url.rstrip("/") + "/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    work = [(op, case) for op in operations
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
            for case in _cases(op, mode, examples, seed)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    checks = _checks()
    result = FuzzResult()
    lock = threading.Lock()
    local = threading.local()

    def run(item: tuple[Any, Any]) -> None:
        op, case = item
        if not hasattr(local, "session"):
            local.session = requests.Session()
        label = f"{op.method.upper()} {op.path}"
        try:
            response = case.call(base_url=base_url, session=local.session, headers=headers,
                                 timeout=timeout_s)
        except requests.RequestException as e:
            with lock:
                result.requests += 1
                result.by_operation[label] += 1
                result.dropped.append(f"{label}: {type(e).__name__}: {e}"[:300])
            local.session = requests.Session()
            return
        failures: list[str] = []
        detail = ""
        try:
            case.validate_response(response, checks=checks, headers=headers)
        except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 -- a group of failures
            found = list(getattr(e, "exceptions", [e]))
            failures = [getattr(f, "title", type(f).__name__) for f in found]
            detail = "; ".join(str(f).replace("\n", " ")[:300] for f in found)
        with lock:
            result.requests += 1
            result.by_operation[label] += 1
            result.by_status[str(response.status_code)] += 1
            result.server_errors += response.status_code >= 500
            for title in failures:
                result.violations[f"{label}: {title}"] += 1
            if failures and len(result.examples) < 20:
                body = case.body if not isinstance(case.body, bytes) else case.body[:200]
                result.examples.append(f"{label} {failures} -> {response.status_code} "
                                       f"{response.text[:200]!r}; body {str(body)[:300]}; "
                                       f"why: {detail}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(run, work))
    result.duration_s = time.perf_counter() - t0
    return result
