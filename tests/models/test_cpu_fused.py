"""The fused CPU decode step (nybble.models.cpu_fused, nybble.kernels.cpu.decoder) against the
model's torch path: the same final hidden states and the same KV-cache writes for a decode step
of sequences with different lengths and blocks, on every tiny variant (GQA, llama3 RoPE, q/k/v
bias, Qwen2); bad indices raise before anything is written; models it cannot take say why.
Greedy outputs through the engine (fused by default on CPU) equal transformers' in
tests/runtime/test_engine_hf_parity.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble.config import ModelConfig
from nybble.kernels.cpu.backend import CpuAttentionBackend
from nybble.kernels.interface import AttentionMetadata
from nybble.models.cpu_fused import FusedCpuDecode
from nybble.models.loader import load_model

from .hf_tiny import VARIANTS, make_tiny_model

BLOCK, BLOCKS = 4, 32


def _meta(slots: list[int], starts: list[int], lens: list[int], tables: list[list[int]]
          ) -> AttentionMetadata:
    q = np.diff(starts)
    return AttentionMetadata(
        torch.tensor(slots, dtype=torch.int64), torch.tensor(starts, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
        int(q.max()), max(lens), bool((q == 1).all()))


def _setup(path: str, kv_dtype: torch.dtype = torch.float32):
    loaded = load_model(ModelConfig(model=path, dtype="float32", max_model_len=64, device="cpu"),
                        CpuAttentionBackend(), torch.device("cpu"))
    model = loaded.model
    attn = model.layers[0].self_attn
    caches = [torch.zeros(2, BLOCKS, BLOCK, attn.num_kv_heads, attn.head_dim, dtype=kv_dtype)
              for _ in model.layers]
    return model, caches


# three sequences: prompt lengths 5, 9, 2 in scattered blocks
TABLES = [[7, 3, 0, 0], [1, 12, 30, 0], [20, 0, 0, 0]]
PROMPTS = [[1, 17, 99, 4, 250], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 300]]


def _slot(table: list[int], pos: int) -> int:
    return table[pos // BLOCK] * BLOCK + pos % BLOCK


def _prefill_args(first: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The prompts' tokens from position ``first`` on (earlier ones cached: a later chunk)."""
    ids = torch.tensor([t for p in PROMPTS for t in p[first:]])
    pos = torch.tensor([i for p in PROMPTS for i in range(first, len(p))])
    slots = [_slot(TABLES[s], i) for s, p in enumerate(PROMPTS) for i in range(first, len(p))]
    starts = list(np.cumsum([0] + [len(p) - first for p in PROMPTS]))
    return ids, pos, _meta(slots, starts, [len(p) for p in PROMPTS], TABLES)


def _prefill(model, caches, first: int = 0) -> torch.Tensor:
    with torch.no_grad():
        return model(*_prefill_args(first)[:2], caches, _prefill_args(first)[2])


def _decode_meta(tokens: int = 3) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    lens = [len(p) + 1 for p in PROMPTS][:tokens]
    ids = torch.tensor([42, 7, 311][:tokens])
    pos = torch.tensor([n - 1 for n in lens])
    slots = [_slot(TABLES[s], n - 1) for s, n in enumerate(lens)]
    return ids, pos, _meta(slots, list(range(tokens + 1)), lens, TABLES[:tokens])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_step_equals_the_torch_path(variant: str, tmp_path) -> None:
    model, caches = _setup(make_tiny_model(variant, str(tmp_path)))
    _prefill(model, caches)
    ids, pos, meta = _decode_meta()
    torch_caches = [c.clone() for c in caches]
    with torch.no_grad():
        want = model(ids, pos, torch_caches, meta)   # not enabled yet: the torch path
    assert model.enable_fused_cpu_decode(caches).startswith("fused C step")
    got = model(ids, pos, caches, meta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for c, tc in zip(caches, torch_caches):
        torch.testing.assert_close(c, tc, rtol=1e-6, atol=1e-6)
    portable = model.fused_decode.decoder  # the portable C loop computes the same step
    out = np.empty((3, model.config.hidden_size), np.float32)
    portable.forward(ids.numpy(), pos.numpy(), meta.slot_mapping.numpy(),
                     meta.block_tables.numpy(), meta.seq_lens.numpy(), out, portable=True)
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 1, 72), (2, 2, 64), (4, 2, 12)])
@pytest.mark.parametrize("tokens", [1, 3])
def test_fused_attention_of_every_head_size(heads, kv_heads, head_dim, tokens, kv_dtype,
                                            tmp_path) -> None:
    """Head sizes the AVX2 attention takes 64 outputs at a time (64), 64 and then 8 (72), and
    one it leaves to the plain loop (12, not a multiple of 8): one sequence (T == 1) and
    several decode rows equal the torch path, and the portable loop agrees; so do the KV
    writes, also to a bfloat16 cache (rounded to nearest even as torch's cast)."""
    path = make_tiny_model("llama-gqa", str(tmp_path), num_attention_heads=heads,
                           num_key_value_heads=kv_heads, head_dim=head_dim)
    model, caches = _setup(path, kv_dtype)
    assert model.layers[0].self_attn.head_dim == head_dim
    _prefill(model, caches)
    ids, pos, meta = _decode_meta(tokens)
    torch_caches = [c.clone() for c in caches]
    with torch.no_grad():
        want = model(ids, pos, torch_caches, meta)
    assert model.enable_fused_cpu_decode(caches).startswith("fused C step")
    got = model(ids, pos, caches, meta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the same writes: float32 ones within the RoPE's last bits, bfloat16 ones within one
    # bfloat16 step (a float32 key a last bit apart may round the other way)
    tol = 1e-6 if kv_dtype == torch.float32 else 2.0**-8
    for c, tc in zip(caches, torch_caches):
        assert c.dtype == kv_dtype
        torch.testing.assert_close(c.float(), tc.float(), rtol=tol, atol=1e-6)
    out = np.empty((tokens, model.config.hidden_size), np.float32)
    model.fused_decode.decoder.forward(ids.numpy(), pos.numpy(), meta.slot_mapping.numpy(),
                                       meta.block_tables.numpy(), meta.seq_lens.numpy(), out,
                                       portable=True)
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=1e-5, atol=1e-5)


def test_bfloat16_cache_holds_the_float32_step_writes_rounded_to_nearest_even(tmp_path) -> None:
    """The same first decode step (three sequences at position 0) on a float32 cache and on a
    bfloat16 one: the first layer's bfloat16 cache holds exactly torch's round-to-nearest-even
    cast of what the float32 step wrote there (later layers' inputs already differ: at
    position 0 a token's attention output is its own value, read back rounded), and the
    outputs agree within bfloat16's precision."""
    path = make_tiny_model("llama-gqa", str(tmp_path))
    ids, pos = torch.tensor([42, 7, 311]), torch.zeros(3, dtype=torch.int64)
    meta = _meta([_slot(t, 0) for t in TABLES], [0, 1, 2, 3], [1, 1, 1], TABLES)
    outs, written = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        model, caches = _setup(path, dtype)
        assert model.enable_fused_cpu_decode(caches).startswith("fused C step")
        outs[dtype], written[dtype] = model(ids, pos, caches, meta), caches
    c32, c16 = written[torch.float32][0], written[torch.bfloat16][0]
    assert c16.abs().sum() > 0
    assert torch.equal(c32.to(torch.bfloat16).view(torch.int16), c16.view(torch.int16))
    torch.testing.assert_close(outs[torch.bfloat16], outs[torch.float32], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2"])
def test_small_model_prefill_and_chunks_equal_the_torch_path(variant: str, tmp_path) -> None:
    """A small model runs prefill fused too (a row per token, causal by its position): a
    first chunk of each prompt, then the rest, equal the torch path's hidden states and
    KV-cache writes."""
    model, caches = _setup(make_tiny_model(variant, str(tmp_path)))
    torch_caches = [c.clone() for c in caches]
    assert model.enable_fused_cpu_decode(caches).startswith("fused C step (every step")
    fused = model.fused_decode
    chunk = 1  # PROMPTS' shortest is 2 tokens: every prompt has a first chunk and a rest
    first = torch.tensor([p[0] for p in PROMPTS]), torch.tensor([0] * 3), _meta(
        [_slot(t, 0) for t in TABLES], [0, 1, 2, 3], [chunk] * 3, TABLES)
    for step_args, caches_now in ((first, caches), (_prefill_args(chunk), caches)):
        got = model(*step_args[:2], caches_now, step_args[2])
        model.fused_decode = None
        with torch.no_grad():
            want = model(*step_args[:2], torch_caches, step_args[2])
        model.fused_decode = fused
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for c, tc in zip(caches, torch_caches):
            torch.testing.assert_close(c, tc, rtol=1e-6, atol=1e-6)


def _chunk_args(lo: int, hi: int | None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Positions ``lo`` up to ``hi`` (None: the end) of every prompt longer than ``lo``,
    earlier positions cached: several new tokens per sequence, as in a prefill chunk or a
    speculative verification step."""
    seqs = [s for s, p in enumerate(PROMPTS) if len(p) > lo]
    spans = [range(lo, len(PROMPTS[s]) if hi is None else min(hi, len(PROMPTS[s])))
             for s in seqs]
    ids = torch.tensor([PROMPTS[s][i] for s, r in zip(seqs, spans) for i in r])
    pos = torch.tensor([i for r in spans for i in r])
    slots = [_slot(TABLES[s], i) for s, r in zip(seqs, spans) for i in r]
    starts = list(np.cumsum([0] + [len(r) for r in spans]))
    return ids, pos, _meta(slots, starts, [r.stop for r in spans], [TABLES[s] for s in seqs])


def test_larger_model_runs_steps_up_to_the_token_cap_fused(tmp_path, monkeypatch) -> None:
    """A model that is not small runs fused every step of at most MAX_FUSED_TOKENS tokens,
    prefill chunks and multi-token rows per sequence (speculative verification) too, with the
    torch path's hidden states and KV writes; a step of more tokens, or over other caches, is
    left to the torch path (None)."""
    model, caches = _setup(make_tiny_model("llama-gqa", str(tmp_path)))
    monkeypatch.setattr("nybble.models.cpu_fused.SMALL_MODEL_BYTES", 0)  # not a small model
    assert model.enable_fused_cpu_decode(caches).startswith("fused C step (steps of up to")
    fused, torch_caches = model.fused_decode, [c.clone() for c in caches]
    for lo, hi in ((0, 3), (3, None)):   # 8 tokens, then the 8 left (2 and 6 per sequence)
        ids, pos, meta = _chunk_args(lo, hi)
        got = fused(ids, pos, caches, meta)
        assert got is not None
        with torch.no_grad():
            model.fused_decode = None
            want = model(ids, pos, torch_caches, meta)
            model.fused_decode = fused
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for c, tc in zip(caches, torch_caches):
            torch.testing.assert_close(c, tc, rtol=1e-6, atol=1e-6)
    ids, pos, meta = _decode_meta()
    assert fused(ids, pos, [c.clone() for c in caches], meta) is None   # other caches
    assert fused(ids, pos, caches, meta) is not None
    monkeypatch.setattr("nybble.models.cpu_fused.MAX_FUSED_TOKENS", 2)
    assert fused(ids, pos, caches, meta) is None   # 3 tokens > the cap
    assert fused(*_chunk_args(0, 3)[:2], caches, _chunk_args(0, 3)[2]) is None


def test_bad_indices_raise_and_write_nothing(tmp_path) -> None:
    model, caches = _setup(make_tiny_model("qwen2", str(tmp_path)))
    model.enable_fused_cpu_decode(caches)
    ids, pos, meta = _decode_meta()
    before = [c.clone() for c in caches]
    bad_id = ids.clone()
    bad_id[1] = model.config.vocab_size
    bad_table = _meta(meta.slot_mapping.tolist(), list(range(4)), meta.seq_lens.tolist(),
                      [[7, 3, 0, 0], [1, 12, BLOCKS, 0], [20, 0, 0, 0]])
    too_long = _meta(meta.slot_mapping.tolist(), list(range(4)), [6, 10, 4 * BLOCK + 1],
                     TABLES)
    for args in ((bad_id, pos, meta), (ids, pos, bad_table), (ids, pos, too_long)):
        with pytest.raises(ValueError, match="an index is out of range"):
            model.fused_decode(*args[:2], caches, args[2])
        assert all(torch.equal(c, b) for c, b in zip(caches, before))


def test_models_it_cannot_take_say_why(tmp_path) -> None:
    path = make_tiny_model("llama-gqa", str(tmp_path))
    model, caches = _setup(path, kv_dtype=torch.int8)
    assert FusedCpuDecode.build(model, caches) == (None, "the KV cache must be float32 or "
                                                         "bfloat16")
    model, caches = _setup(path)
    model.to(torch.float16)
    assert model.enable_fused_cpu_decode(caches).startswith("weights must be float32")
    assert model.fused_decode is None


def test_engine_uses_it_on_cpu_unless_enforce_eager() -> None:
    """The runner turns the fused step on for the bundled model on the CPU (and greedy text
    equals the op-by-op path's); ``enforce_eager`` keeps the torch path."""
    outs = {eager: greedy_tokens(eager, lambda llm: llm.llm_engine.loaded.model)
            for eager in (False, True)}
    assert outs[False] == outs[True]


def test_speculative_draft_model_runs_it_and_output_is_unchanged() -> None:
    """With a draft model (the bundled model drafting for itself), the runner turns the fused
    step on for the draft too; greedy text equals the op-by-op path's (``enforce_eager``)."""
    from nybble.config import DEFAULT_MODEL

    spec = {"model": DEFAULT_MODEL, "num_speculative_tokens": 3}
    outs = {eager: greedy_tokens(eager, lambda llm: llm.llm_engine.engine_core.runner.proposer
                                 .model, speculative_config=spec)
            for eager in (False, True)}
    assert outs[False] == outs[True]


def greedy_tokens(eager: bool, fused_model, **llm_args) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """24 greedy tokens for three prompts through ``LLM(enforce_eager=eager, **llm_args)``,
    after checking that ``fused_model(llm)`` runs the fused step exactly when not eager."""
    from nybble import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["Once upon a time", "The dog ran to the", "Lily"]
    llm = LLM(max_num_seqs=4, kv_cache_memory=8 * 2**20, enforce_eager=eager, **llm_args)
    assert (fused_model(llm).fused_decode is None) == eager
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def steps_on_threads(model, caches, ids, pos, meta, counts) -> list:
    """The fused step from the same KV caches on each thread count of ``counts``:
    ``[(hidden states, KV caches)]`` (the kernels' pools back at one thread afterwards)."""
    from nybble.kernels.cpu.threads import set_kernel_threads

    start = [c.clone() for c in caches]
    results = []
    try:
        for threads in counts:
            set_kernel_threads(threads)
            for c, s in zip(caches, start):
                c.copy_(s)
            results.append((model(ids, pos, caches, meta).clone(), [c.clone() for c in caches]))
    finally:
        set_kernel_threads(1)
    return results


def test_dense_step_on_threads_writes_what_one_thread_writes(tmp_path) -> None:
    """The float32 step's projections split by output-feature pairs and its attention by
    sequence over two threads (pool.h): hidden states and KV equal the one-thread step's."""
    model, caches = _setup(make_tiny_model("llama-gqa", str(tmp_path)))
    _prefill(model, caches)
    ids, pos, meta = _decode_meta()
    assert model.enable_fused_cpu_decode(caches).startswith("fused C step")
    (want, want_kv), (got, kv) = steps_on_threads(model, caches, ids, pos, meta, (1, 2))
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(kv, want_kv))
