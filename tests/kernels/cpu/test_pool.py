"""The C kernels' thread pool (nybble/kernels/cpu/pool.h): a GEMM split over several threads
writes exactly what one thread writes (each output column block is computed by one chunk
with the same code), for the integer-dot, bf16-dot and float32 weight-only kernels, decode and
prefill row
counts, column counts that leave a short last chunk; calls from several Python threads at
once and from a forked child are correct; the thread setting is clamped and reported."""
from __future__ import annotations

import dataclasses
import multiprocessing
import threading

import numpy as np
import pytest
import torch

from nybble.kernels.cpu import decoder as cpu_decoder
from nybble.kernels.cpu import qgemm as cpu_qgemm
from nybble.kernels.cpu import qgemm_pack as cpu_qgemm_pack
from nybble.kernels.cpu import weight_only as cpu_weight_only
from nybble.kernels.cpu import wo_gemm as cpu_wo_gemm
from nybble.kernels.cpu.threads import set_kernel_threads
from tests.kernels.cpu.test_qgemm import _weight

KINDS = ["int16", "int8"] + (["bfloat16"] if cpu_qgemm.have_bf16() else [])


@pytest.fixture(autouse=True)
def _one_thread_after():
    yield
    set_kernel_threads(1)


def _packed(bits: int, k: int, n: int, kind: str, mode: str = "min"):
    iw, scales, mins = _weight(bits, k, n, 32, mode, False, seed=bits * 3 + n)
    packed, why = cpu_qgemm_pack.pack(iw, scales, mins, activations=kind)
    assert packed is not None, why
    return packed


def _run(x: np.ndarray, packed, n: int, bias: np.ndarray | None, acc: np.ndarray | None):
    out = np.zeros((x.shape[0], n), np.float32) if acc is None else acc.copy()
    cpu_qgemm.qgemm(x, packed, out, bias, accumulate=acc is not None)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits,k,n", [(4, 576, 960), (4, 1536, 576), (8, 576, 3000),
                                      (4, 64, 40), (8, 96, 1000)])
@pytest.mark.parametrize("rows", [1, 2, 5, 70])
def test_threads_write_what_one_thread_writes(kind, bits, k, n, rows) -> None:
    packed = _packed(bits, k, n, kind)
    g = np.random.default_rng(rows + n)
    x = g.standard_normal((rows, k), dtype=np.float32)
    bias = g.standard_normal(n, dtype=np.float32)
    acc = g.standard_normal((rows, n), dtype=np.float32)
    assert cpu_qgemm.set_threads(1) == 1
    want = _run(x, packed, n, bias, None)
    want_acc = _run(x, packed, n, None, acc)
    for threads in (2, 3, 7):
        assert cpu_qgemm.set_threads(threads) == threads == cpu_qgemm.get_threads()
        np.testing.assert_array_equal(_run(x, packed, n, bias, None), want)
        np.testing.assert_array_equal(_run(x, packed, n, None, acc), want_acc)


@pytest.mark.parametrize("bits,k,n,mode", [(4, 576, 960, "min"), (4, 1536, 576, "zero"),
                                           (8, 576, 3000, "zero"), (4, 64, 40, "sym"),
                                           (8, 96, 1000, "min")])
@pytest.mark.parametrize("rows", [1, 2, 17, 70])
@pytest.mark.parametrize("portable", [False, True])
def test_weight_only_threads_write_what_one_thread_writes(bits, k, n, mode, rows,
                                                          portable) -> None:
    """The float32 weight-only kernel (the exact path, the default without AVX-512) splits its
    32-column blocks over the module's pool: the same bytes for any thread count."""
    iw, scales, mins = _weight(bits, k, n, 32, mode, False, seed=bits + n + rows)
    if mins is not None:
        iw = dataclasses.replace(iw, mins=mins)
    w, why = cpu_weight_only.prepare(iw, scales)
    assert w is not None, why
    x = np.random.default_rng(rows).standard_normal((rows, k), dtype=np.float32)

    def run() -> np.ndarray:
        out = np.full((rows, n + 3), 7.0, np.float32)
        cpu_wo_gemm.wo_gemm(x, w, out, portable)
        return out

    assert cpu_wo_gemm.set_threads(1) == 1
    want = run()
    assert bool((want[:, n:] == 7.0).all())
    for threads in (2, 3, 7):
        assert cpu_wo_gemm.set_threads(threads) == threads == cpu_wo_gemm.get_threads()
        np.testing.assert_array_equal(run(), want)


def test_concurrent_callers_are_correct() -> None:
    """Two Python threads share one pool: one gets it, the other runs serially (pool busy),
    and both results are exact."""
    packed = _packed(4, 576, 2048, "int16")
    g = np.random.default_rng(0)
    xs = [g.standard_normal((m, 576), dtype=np.float32) for m in (1, 9)]
    want = [_run(x, packed, 2048, None, None) for x in xs]
    cpu_qgemm.set_threads(2)
    errors: list[str] = []

    def work(i: int) -> None:
        for _ in range(40):
            got = _run(xs[i], packed, 2048, None, None)
            if not np.array_equal(got, want[i]):
                errors.append(f"caller {i}: differs by {np.abs(got - want[i]).max()}")
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _child(conn) -> None:
    packed = _packed(4, 576, 960, "int16")
    x = np.ones((3, 576), np.float32)
    conn.send((cpu_qgemm.get_threads(), _run(x, packed, 960, None, None)))


def test_a_forked_child_runs_on_its_own_thread() -> None:
    packed = _packed(4, 576, 960, "int16")
    want = _run(np.ones((3, 576), np.float32), packed, 960, None, None)
    cpu_qgemm.set_threads(2)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(child,))
    p.start()
    threads, got = parent.recv()
    p.join(30)
    assert p.exitcode == 0 and threads == 1
    np.testing.assert_array_equal(got, want)
    assert cpu_qgemm.get_threads() == 2     # the parent's pool is untouched


def test_the_setting_is_clamped_and_applied_to_every_module() -> None:
    assert cpu_qgemm.set_threads(0) == 1
    assert cpu_qgemm.set_threads(1000) == 64
    assert set_kernel_threads(2) == {"nybble.kernels.cpu.qgemm": 2,
                                     "nybble.kernels.cpu.wo_gemm": 2,
                                     "nybble.kernels.cpu.decoder": 2}
    assert cpu_decoder.get_threads() == 2 and cpu_qgemm.get_threads() == 2
    assert cpu_wo_gemm.get_threads() == 2
    with pytest.raises(ValueError, match="threads must be >= 1"):
        set_kernel_threads(0)


def test_torch_threads_setting_reaches_the_kernels() -> None:
    from nybble.runtime.worker.torch_threads import apply_torch_threads

    before = torch.get_num_threads()
    try:
        apply_torch_threads(2, "test")
        assert cpu_qgemm.get_threads() == 2 and cpu_decoder.get_threads() == 2
    finally:
        apply_torch_threads(before, "test")
