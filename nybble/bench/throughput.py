"""``nybble bench throughput``: offline throughput of nybble against Hugging Face batching.

Like ``vllm bench throughput``: N requests (default 256) are submitted at once, timing excludes
model load and a short warm-up. In the same process and run, the same requests go through
transformers ``generate`` in static batches of the same cap (``--max-num-seqs``), same model,
dtype, exact output lengths (``ignore_eos``) and torch threads. ``--sweep-max-num-seqs 8,32,128``
repeats both for several caps; ``--num-runs`` keeps the median run (by elapsed time) per cap
and backend.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from nybble.bench.models import model_max_len, model_vocab_size, resolve_model
from nybble.bench.report import print_table, write_json
from nybble.bench.stats import BackendResult
from nybble.bench.workloads import BenchRequest, WorkloadConfig, build_requests, describe
from nybble.threads import resolve_threads

logger = logging.getLogger(__name__)

_WARMUP = [BenchRequest([1, 5, 6, 7, 8, 9, 10, 11], 4), BenchRequest([1, 12, 13, 14], 4)]


@dataclass(frozen=True)
class ThroughputConfig:
    """Everything one ``bench throughput`` invocation needs.

    Attributes:
        model: model folder (aliases already resolved).
        backend: ``nybble``, ``hf`` or ``both``.
        batch_caps: the ``max_num_seqs`` values to run (HF uses each as its batch size).
        workload: the request set.
        engine_kwargs: nybble ``LLM`` keyword arguments except ``max_num_seqs``.
        dtype: model dtype name for both backends.
        threads: torch intra-op threads for both backends.
        num_runs: repetitions per cap and backend; the median run is reported.
        warmup: run two tiny requests through each backend before timing.
        output: JSON path or ``None``.
    """

    model: str
    backend: str = "both"
    batch_caps: tuple[int, ...] = (256,)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: str = "auto"
    threads: int = 1
    num_runs: int = 1
    warmup: bool = True
    output: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("nybble", "hf", "both"):
            raise ValueError(f"backend must be nybble, hf or both, got {self.backend!r}")
        if self.num_runs < 1:
            raise ValueError(f"num_runs must be >= 1, got {self.num_runs}")
        if any(c < 1 for c in self.batch_caps):
            raise ValueError(f"batch caps must be >= 1, got {self.batch_caps}")


def _median_run(runs: list[BackendResult]) -> BackendResult:
    """The run whose elapsed time is the median (lower median for even counts)."""
    ordered = sorted(runs, key=lambda r: r.elapsed_s)
    return ordered[(len(ordered) - 1) // 2]


def _run_cap(cfg: ThroughputConfig, requests: list[BenchRequest], cap: int,
             hf_model: Any) -> dict[str, Any]:
    """Both backends at one cap; returns ``{"max_num_seqs", "nybble", "hf", "ratio"}``."""
    from nybble.bench import hf_runner, nybble_runner

    llm = None
    if cfg.backend in ("nybble", "both"):
        llm = nybble_runner.make_llm(cfg.model, {**cfg.engine_kwargs, "max_num_seqs": cap})
    block = int(cfg.engine_kwargs.get("block_size", 16))
    runs: dict[str, list[BackendResult]] = {"nybble": [], "hf": []}
    if cfg.warmup:
        if llm is not None:
            nybble_runner.run_nybble(llm, _WARMUP, block)
        if hf_model is not None:
            hf_runner.run_hf(hf_model, _WARMUP, cap)
    for i in range(cfg.num_runs):  # interleave so drift on a shared machine hits both
        if llm is not None:
            runs["nybble"].append(nybble_runner.run_nybble(llm, requests, block))
            logger.info("cap %d run %d nybble %.1fs", cap, i, runs["nybble"][-1].elapsed_s)
        if hf_model is not None:
            runs["hf"].append(hf_runner.run_hf(hf_model, requests, cap))
            logger.info("cap %d run %d hf %.1fs", cap, i, runs["hf"][-1].elapsed_s)
    del llm
    out: dict[str, Any] = {"max_num_seqs": cap}
    for name, rs in runs.items():
        if rs:
            out[name] = {**_median_run(rs).to_dict(),
                         "elapsed_s_runs": [r.elapsed_s for r in rs]}
    if "nybble" in out and "hf" in out:
        out["ratio"] = {k: out["nybble"][k] / out["hf"][k] for k in
                        ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")}
    return out


def _rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for res in results:
        for name in ("nybble", "hf"):
            if name not in res:
                continue
            r = res[name]
            rows.append({"max_seqs": res["max_num_seqs"], "backend": name,
                         "requests": r["num_requests"], "out_tok": r["output_tokens"],
                         "elapsed_s": r["elapsed_s"], "req/s": r["requests_per_s"],
                         "out_tok/s": r["output_tokens_per_s"],
                         "total_tok/s": r["total_tokens_per_s"],
                         "kv_waste_mean": r["kv_waste_mean"], "kv_waste_peak": r["kv_waste_peak"],
                         "nybble/hf": res["ratio"]["total_tokens_per_s"]
                         if "ratio" in res else None})
    return rows


def run_throughput(cfg: ThroughputConfig) -> dict[str, Any]:
    """Run the benchmark, print its table, write JSON if asked; returns the JSON payload."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(cfg.threads)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    requests = build_requests(cfg.workload, tokenizer, model_vocab_size(cfg.model))
    hf_model = None
    if cfg.backend in ("hf", "both"):
        from nybble.bench.hf_runner import load_hf_model

        hf_model = load_hf_model(cfg.model, cfg.dtype)
    results = [_run_cap(cfg, requests, cap, hf_model) for cap in cfg.batch_caps]
    payload = {"benchmark": "throughput", "model": cfg.model,
               "config": {**dataclasses.asdict(cfg), "threads": torch.get_num_threads()},
               "workload": describe(requests), "results": results}
    print_table(_rows(results), title=f"nybble bench throughput: {cfg.model} "
                f"({cfg.workload.kind}, {len(requests)} requests, {cfg.threads} threads)")
    if cfg.output:
        write_json(cfg.output, payload)
    return payload


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench throughput`` besides the engine flags."""
    parser.add_argument("--backend", default="both", choices=["nybble", "hf", "both"])
    parser.add_argument("--num-prompts", "--num-requests", dest="num_prompts", type=int,
                        default=256, help="number of requests")
    parser.add_argument("--sweep-max-num-seqs", default=None,
                        help="comma-separated batch caps to run in turn, e.g. 8,32,128 "
                             "(default: --max-num-seqs)")
    parser.add_argument("--num-runs", type=int, default=1,
                        help="runs per cap and backend; the median run is reported")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--output", "-o", default=None, help="write the results as JSON here")
    add_workload_args(parser)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Request-set flags shared by ``bench throughput`` and ``bench serve``."""
    parser.add_argument("--workload", default="mixed", choices=["mixed", "fixed"],
                        help="mixed: log-normal prompt/output lengths; fixed: --input-len/"
                             "--output-len")
    parser.add_argument("--input-len", type=int, default=128, help="fixed set prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="fixed set output tokens")
    parser.add_argument("--context-budget", type=int, default=None,
                        help="most prompt + output tokens per request (default: "
                             "--max-model-len, else the model's max_position_embeddings)")
    parser.add_argument("--dataset", default=None,
                        help="text file to cut prompts from (default: random vocabulary tokens)")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the request set")


def workload_from_args(args: argparse.Namespace, model: str, num: int) -> WorkloadConfig:
    """The :class:`WorkloadConfig` of parsed :func:`add_workload_args` flags."""
    budget = (args.context_budget or getattr(args, "max_model_len", None)
              or model_max_len(model))
    return WorkloadConfig(kind=args.workload, num_requests=num, context_budget=budget,
                          input_len=args.input_len, output_len=args.output_len,
                          dataset=args.dataset, seed=args.workload_seed)


def throughput_config_from_args(args: argparse.Namespace) -> ThroughputConfig:
    """Build the :class:`ThroughputConfig` from parsed flags (engine flags included)."""
    from nybble.engine_args import engine_config_from_args

    args.model = resolve_model(args.model)
    ecfg = engine_config_from_args(args)  # validates the engine flags
    caps = (tuple(int(c) for c in args.sweep_max_num_seqs.split(","))
            if args.sweep_max_num_seqs else (args.max_num_seqs,))
    kwargs = {**dataclasses.asdict(ecfg.model_config), **dataclasses.asdict(ecfg.cache_config),
              **dataclasses.asdict(ecfg.scheduler_config),
              **dataclasses.asdict(ecfg.compilation_config),
              "attention_backend": ecfg.attention_backend, "disable_log_stats": True}
    model = kwargs.pop("model")
    kwargs.pop("max_num_seqs")
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return ThroughputConfig(model=model, backend=args.backend, batch_caps=caps,
                            workload=workload_from_args(args, model, args.num_prompts),
                            engine_kwargs=kwargs, dtype=args.dtype,
                            threads=resolve_threads(args.threads)[0],
                            num_runs=args.num_runs, warmup=args.warmup, output=args.output)
