"""Comparison of local raw tensors read piece by piece on the threads that compare them
(ckpt.tools.valuediff over ckpt.tools.fused): the same bits as the chunked path, exact counts and
maxima against an oracle, and a damaged piece of either file refuses the pair."""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest

import ckpt
from ckpt.tools import valuediff as _vd
from ckpt.tools.chunks import paired_chunks
from ckpt.tools.fused import local_layout

MiB = 1 << 20
CHUNK = _vd.CHUNK
ODD = 2 * MiB + 5 * CHUNK // 2 + 123  # three 4 MiB chunks of float32 (the odd one first), not whole pieces


def _pairs() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(29)
    a: dict[str, np.ndarray] = {}
    b: dict[str, np.ndarray] = {}
    x = rng.standard_normal(ODD).astype(np.float32)
    a["odd"], b["odd"] = x, x + np.float32(1e-3)  # a training step: every value moves
    y = rng.standard_normal(ODD).astype(np.float32)
    late = y.copy()
    late[-CHUNK - 5:] += 1  # the first chunks are the same bytes, the last one's last pieces differ
    a["late"], b["late"] = y, late
    z = (rng.standard_normal(3 * MiB + 777) * 3).astype(np.float32)
    a["last"], b["last"] = z, z.copy()
    b["last"][-1] += 1  # only the last value differs: every earlier chunk adds A's norm in order
    special = rng.standard_normal(5 * CHUNK + 9).astype(np.float32)
    other = special * np.float32(1.01)
    special[[3, 70_000, 200_000]] = [np.nan, np.inf, -0.0]
    other[[3, 70_000, 200_000, 200_001]] = [np.nan, np.inf, 0.0, np.nan]  # -0.0 == 0.0; a NaN vs a number
    special[[300_000, 300_001]] = [1e-42, -1e-45]  # subnormals
    other[[300_000, 300_001]] = [2e-42, 1e-45]
    a["special"], b["special"] = special, other
    same = rng.standard_normal(3 * CHUNK + 1).astype(np.float32)
    a["same"], b["same"] = same, same.copy()
    a["small"] = rng.standard_normal(1000).astype(np.float32)  # under one piece
    b["small"] = a["small"] + np.float32(0.5)
    a["half"] = rng.standard_normal(CHUNK * 4 + 17).astype(np.float16)
    b["half"] = (a["half"] * np.float16(0.9)).astype(np.float16)
    a["f64"] = rng.standard_normal(CHUNK + 3)
    b["f64"] = a["f64"] - 1e-9
    a["ints"] = rng.integers(-50, 50, CHUNK * 2 + 1).astype(np.int8)
    b["ints"] = a["ints"] ^ np.int8(1)
    a["scalar"], b["scalar"] = np.array(3.5), np.array(3.25)
    a["empty"], b["empty"] = np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32)
    return a, b


@pytest.fixture(params=[".msgpack", ".h5"])
def saved(request, tmp_path) -> tuple[str, str, dict[str, np.ndarray], dict[str, np.ndarray]]:
    a, b = _pairs()
    pa, pb = str(tmp_path / f"a{request.param}"), str(tmp_path / f"b{request.param}")
    ckpt.save_file(a, pa)
    ckpt.save_file(b, pb)
    return pa, pb, a, b


def _chunked(ra, rb, key: str, atol: float, rtol: float, chunk_bytes: int | None) -> tuple[object, ...]:
    """The comparison through paired_chunks (the path every other pair of sources takes), as _bits."""
    tally = _vd._Tally()
    for ca, cb in paired_chunks(ra, rb, key, chunk_bytes=chunk_bytes):
        _vd._add_chunk(tally, ca, cb, atol, rtol)
    return _bits(tally.result(), tally)


def _fused(ra, rb, key: str, atol: float, rtol: float, chunk_bytes: int | None) -> tuple[object, ...]:
    tally = _vd._Tally()
    found = _vd._fused_values(ra, rb, key, atol, rtol, tally, chunk_bytes)
    assert found is not None, key  # the fused path is the one taken
    return _bits(found, tally)


def _bits(v: ckpt.ValueDiff, tally: _vd._Tally) -> tuple[object, ...]:
    """Every field and the float64 sums under rel_l2, floats as their bits (NaN equal to NaN)."""
    return tuple(np.float64(x).tobytes() if isinstance(x, float) else x for x in
                 (v.count, v.unequal, v.outside, v.max_abs, v.max_rel, v.rel_l2, tally.sum_a2, tally.sum_d2))


@pytest.mark.parametrize("chunk_bytes", [None, 4 * MiB])
@pytest.mark.parametrize("tol", [(0.0, 0.0), (1e-4, 1e-3)])
def test_pieces_read_by_their_threads_are_the_same_bits_as_the_chunked_path(saved, chunk_bytes, tol):
    pa, pb, a, _ = saved
    with ckpt.load_checkpoint(pa) as ra, ckpt.load_checkpoint(pb) as rb:
        for key in a:
            assert local_layout(ra, key) is not None and local_layout(rb, key) is not None, key
            assert _fused(ra, rb, key, *tol, chunk_bytes) == _chunked(ra, rb, key, *tol, chunk_bytes), key


def _oracle(a: np.ndarray, b: np.ndarray) -> tuple[int, int, float, float]:
    """unequal, count, max |a - b| and max |a - b| / |b| in float64, element by element."""
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    with np.errstate(invalid="ignore", divide="ignore"):
        neq = (a.ravel() != b.ravel()) & ~(np.isnan(x) & np.isnan(y))
        d = np.where(neq, np.abs(x - y), 0.0)
        d[np.isnan(d)] = np.inf
        rel = np.where(d == 0, 0.0, d / np.abs(y))
        rel[np.isnan(rel)] = np.inf  # a NaN against a number: an infinite difference
    return int(neq.sum()), x.size, float(d.max(initial=0.0)), float(rel.max(initial=0.0))


def test_exact_quantities_match_an_element_by_element_oracle(saved):
    pa, pb, a, b = saved
    got = ckpt.compare(pa, pb)
    for key in a:
        v = got.tensor(key).values
        unequal, count, max_abs, max_rel = _oracle(a[key], b[key])
        assert (v.unequal, v.outside, v.count, v.max_abs, v.max_rel) == (unequal, unequal, count, max_abs, max_rel), key
        if key == "special":  # a NaN against a number: an infinite |a - b|
            assert v.rel_l2 == math.inf
            continue
        x = a[key].astype(np.float64).ravel()
        d = x - b[key].astype(np.float64).ravel()
        expected = 0.0 if not unequal else math.sqrt(float(d @ d)) / math.sqrt(float(x @ x))
        assert v.rel_l2 == pytest.approx(expected, rel=1e-9), key
    assert got.identical == ["empty", "same"]
    special = got.tensor("special").values
    assert special.count - special.unequal == 3  # NaN == NaN, Inf == Inf, -0.0 == 0.0
    assert ckpt.compare(pa, pa).same


def _damaged(path: str, key: str, at: int, out: pathlib.Path) -> str:
    """A copy of ``path`` with one bit flipped in float32 tensor ``key``'s value ``at``."""
    with ckpt.load_checkpoint(path) as reader:
        (offset, _), = reader._reader.data_extents(key)
    data = bytearray(pathlib.Path(path).read_bytes())
    data[offset + 4 * at + 1] ^= 0x10
    out.write_bytes(bytes(data))
    return str(out)


@pytest.mark.parametrize("side", ["a", "b"])
@pytest.mark.parametrize("at", [ODD // 2 + 3, ODD - 2])  # a middle piece, the last one
def test_a_damaged_piece_of_either_file_refuses_the_pair(saved, tmp_path, side, at):
    pa, pb, _, _ = saved
    victim = pa if side == "a" else pb
    bad = _damaged(victim, "odd", at, tmp_path / f"bad{pathlib.Path(victim).suffix}")
    args = (bad, pb) if side == "a" else (pa, bad)
    with pytest.raises(ckpt.CorruptCheckpointError, match="'odd' fails its checksum") as caught:
        ckpt.compare(*args, keys=["odd"])
    assert (caught.value.path, caught.value.key) == (bad, "odd")
    assert ckpt.compare(*args, keys=["small"]).tensor("small").values == ckpt.compare(pa, pb, keys=["small"]) \
        .tensor("small").values


def test_other_pairs_keep_the_chunked_path(tmp_path):
    x = np.random.default_rng(3).standard_normal(CHUNK + 5).astype(np.float32)
    pa = ckpt.save_file({"x": x}, str(tmp_path / "a.msgpack"), compression="zstd")
    pb = ckpt.save_file({"x": x + 1}, str(tmp_path / "b.msgpack"))
    pc = ckpt.save_file({"x": x.astype(np.float64)}, str(tmp_path / "c.msgpack"))
    with ckpt.load_checkpoint(pa) as ra, ckpt.load_checkpoint(pb) as rb, ckpt.load_checkpoint(pc) as rc:
        assert _vd._fused_values(ra, rb, "x", 0.0, 0.0, _vd._Tally(), None) is None  # compressed
        assert _vd._fused_values(rc, rb, "x", 0.0, 0.0, _vd._Tally(), None) is None  # dtypes differ
    assert ckpt.compare(pa, pb).tensor("x").values == ckpt.compare_values(x, x + 1)
    assert ckpt.compare(pc, pb).tensor("x").values.max_abs == pytest.approx(1.0)
