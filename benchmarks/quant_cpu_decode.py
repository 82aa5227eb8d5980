"""Batch-1 CPU decode speed of quantized models against fp32 (issue 14, item 5).

The 134M-shape random Llama of ``nybble bench`` (hidden 768, 12 layers, vocab 32000, float32)
is quantized with RTN into the GPTQ layout (the layout decides the speed, not the rounding),
once per configuration, and cached beside the model. Every model is loaded once through
``nybble.LLM`` (float32 activations, the engine's CPU path, one torch thread). One run of a
model generates ``--output-len`` greedy tokens after a ``--prompt-len`` prompt and, separately,
one token after the same prompt; decode speed = ``(output_len - 1) / (t_full - t_first)``
tokens/s, so prefill and the first token are excluded. Runs alternate between the models
(A, B, C, A, B, C, ...) and each figure is the median over ``--runs``; the load average is
recorded before and after. ``reference`` rows run the same INT4 checkpoint with
``NYBBLE_CPU_WEIGHT_ONLY=0`` (the dequantize-every-call path this replaced), with fewer tokens.

Run: ``python benchmarks/quant_cpu_decode.py``; prints a table and writes
``benchmarks/results/quant_cpu_decode.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]   # benchmarks/ and the repo root, as a script
import torch  # noqa: E402
from _report import print_table, write_json  # noqa: E402

from nybble import LLM, SamplingParams  # noqa: E402
from nybble.bench.models import random_llama  # noqa: E402
from nybble.quantize.driver import QuantizeOptions, quantize_model  # noqa: E402

CONFIGS = {"fp32": None, "int4 g128": (4, 128), "int8 g128": (8, 128),
           "int8 per-channel": (8, -1)}


def quantized(src: str, bits: int, group_size: int) -> str:
    """RTN (asymmetric, ``gptq_v2``) copy of ``src`` at ``bits``/``group_size``, cached."""
    out = f"{src}-rtn-w{bits}g{group_size}"
    if not os.path.isfile(os.path.join(out, "config.json")):
        quantize_model(src, out, QuantizeOptions(method="rtn", bits=bits,
                                                 group_size=group_size), progress=False)
    return out


def decode_seconds(llm: LLM, prompt: list[int], output_len: int) -> float:
    """Seconds for ``output_len - 1`` decode steps (full generation minus prefill + token 1)."""
    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == n
        return time.perf_counter() - t
    return run(output_len) - run(1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the random 134M Llama)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=48, help="generated tokens per run")
    p.add_argument("--reference-output-len", type=int, default=4,
                   help="generated tokens per run of the reference (dequantize-per-call) path; "
                        "0 skips it")
    p.add_argument("--runs", type=int, default=3, help="alternating runs per model")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--out", default=os.path.join(_HERE, "results", "quant_cpu_decode.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    src = args.model or random_llama()
    paths = {name: src if c is None else quantized(src, *c) for name, c in CONFIGS.items()}
    engine = dict(dtype="float32", device="cpu", max_num_seqs=1, kv_cache_memory=64 * 2**20,
                  max_model_len=args.prompt_len + args.output_len + 8)
    llms = {name: LLM(path, **engine) for name, path in paths.items()}
    lens = {name: args.output_len for name in llms}
    if args.reference_output_len:
        os.environ["NYBBLE_CPU_WEIGHT_ONLY"] = "0"
        llms["int4 g128 reference"] = LLM(paths["int4 g128"], **engine)
        del os.environ["NYBBLE_CPU_WEIGHT_ONLY"]
        lens["int4 g128 reference"] = args.reference_output_len
    prompt = [1] + [100 + 7 * i % 400 for i in range(args.prompt_len - 1)]
    load_before = os.getloadavg()
    for name, llm in llms.items():  # warm-up
        decode_seconds(llm, prompt, min(4, lens[name]))
    times: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(args.runs):
        for name, llm in llms.items():
            times[name].append(decode_seconds(llm, prompt, lens[name]) / (lens[name] - 1))
    load_after = os.getloadavg()
    fp32 = statistics.median(times["fp32"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        loaded = llms[name].llm_engine
        rows.append({"model": name, "decode_tok_s": 1.0 / med, "ms_per_token": med * 1e3,
                     "vs_fp32": fp32 / med, "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3,
                     "tokens_per_run": lens[name] - 1,
                     "linear_weight_MiB": _linear_mib(loaded)})
    print_table(rows, f"batch-1 decode, {os.path.basename(src)}, {args.threads} thread(s), "
                      f"load {load_before[0]:.2f} -> {load_after[0]:.2f}")
    write_json(args.out, {"settings": {**vars(args), "model": os.path.basename(src),
                                       "out": os.path.basename(args.out)},
                          "load_avg_before": load_before, "load_avg_after": load_after,
                          "runs_s_per_token": times, "rows": rows})
    return 0


def _linear_mib(engine: object) -> float | None:
    loaded = getattr(engine, "loaded", None)
    b = getattr(loaded, "linear_weight_bytes", None)
    return None if b is None else b / 2**20


if __name__ == "__main__":
    sys.exit(main())
