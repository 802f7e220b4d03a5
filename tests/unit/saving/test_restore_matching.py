"""Restores where every variable matches its tensor exactly: the batched path
(``Reader.match_exact`` / ``read_matched``) that 10,000s of small tensors take, and its way back
to the key-by-key plan for everything else."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from conftest import assert_bit_exact, data_offset, every_dtype_tensors

import ckpt
from ckpt.saving.reader import batch_bounds, open_checkpoint
from ckpt.storage.workers import BIG

MiB = 1 << 20
EXTS = ["msgpack", "h5"]


@pytest.fixture(params=EXTS)
def ext(request):
    return request.param


def _model(count: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer{i:03d}/w": rng.standard_normal(256).astype(np.float32) for i in range(count)}


def _save(path: str, model: dict[str, np.ndarray]) -> str:
    return ckpt.Saver({k: ckpt.Variable(v, name=k) for k, v in model.items()}).save(path)


def _fresh(model: dict[str, np.ndarray]) -> dict[str, ckpt.Variable]:
    """Variables of the model's shapes and dtypes holding other values (nines, or b"?")."""
    return {k: ckpt.Variable(np.full(v.shape, b"?" if v.dtype.kind == "O" else 9, v.dtype), name=f"fresh/{k}")
            for k, v in model.items()}


def _damage(path: str, value: np.ndarray) -> None:
    raw = bytearray(pathlib.Path(path).read_bytes())
    raw[data_offset(path, value) + 5] ^= 0x10
    pathlib.Path(path).write_bytes(raw)


def test_msgpack_matches_by_index_rows_and_reads_them(tmp_path):
    model = _model(50)
    path = _save(str(tmp_path / "m.msgpack"), model)
    keys = list(model)[::-1]  # any order: handles follow the keys asked for
    with open_checkpoint(path) as reader:
        handles = reader.match_exact(keys, [(256,)] * 50, [np.dtype(np.float32)] * 50)
        assert handles == list(range(49, -1, -1))  # row numbers: no TensorInfo built
        out = [np.empty(256, np.float32) for _ in keys]
        reader.read_matched(handles[10:], out[10:])  # any part of the handles at a time
        reader.read_matched(handles[:10], out[:10])
    for key, got in zip(keys, out):
        assert_bit_exact(model[key], got)


@pytest.mark.parametrize("ext_", EXTS)
def test_match_exact_declines_what_is_not_an_exact_match(tmp_path, ext_):
    model = _model(3)
    path = _save(str(tmp_path / f"m.{ext_}"), model)
    keys, f32 = list(model), np.dtype(np.float32)
    with open_checkpoint(path) as reader:
        assert reader.match_exact(keys, [(256,)] * 3, [f32] * 3) is not None
        assert reader.match_exact(keys + ["nope"], [(256,)] * 4, [f32] * 4) is None
        assert reader.match_exact(keys, [(256,), (16, 16), (256,)], [f32] * 3) is None
        assert reader.match_exact(keys, [(256,)] * 3, [f32, np.dtype(np.float64), f32]) is None


def test_shapes_whose_dimensions_only_run_together_do_not_match(tmp_path, ext):
    # back to back, (2, 3), (4,) and (2,), (3, 4) are the same dimensions: the ranks tell them apart
    model = {"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.float32)}
    path = _save(str(tmp_path / f"m.{ext}"), model)
    f32 = np.dtype(np.float32)
    with open_checkpoint(path) as reader:
        assert reader.match_exact(["a", "b"], [(2, 3), (4,)], [f32, f32]) is not None
        assert reader.match_exact(["a", "b"], [(2,), (3, 4)], [f32, f32]) is None
        assert reader.match_exact(["b", "a"], [(3, 4), (2,)], [f32, f32]) is None
    fresh = {"a": ckpt.Variable(np.zeros(2, np.float32), name="a2"), "b": ckpt.Variable(np.zeros((3, 4), np.float32))}
    with pytest.raises(ckpt.MismatchError, match="a: shape \\(2,\\) in the model, \\(2, 3\\)"):
        ckpt.Saver(fresh).restore(path)


@pytest.mark.parametrize("strings", [False, True])  # byte strings send the index's checks entry by entry
@pytest.mark.parametrize(("ext", "compression"), [("msgpack", None), ("h5", None), ("msgpack", "zstd")])
def test_every_dtype_and_mixed_small_and_large_tensors_restore_in_any_order(tmp_path, ext, compression, strings):
    rng = np.random.default_rng(1)
    tensors = [(k, v) for k, v in every_dtype_tensors() if strings or v.dtype.kind != "O"]  # 0-d, bfloat16, ...
    tensors += [("big/a", rng.standard_normal(BIG // 4 + 3).astype(np.float32)),  # read in pieces by the workers
                ("big/b", rng.standard_normal((600, 1000)).astype(np.float64))]
    tensors += list(_model(40, seed=2).items())
    model = dict(tensors)
    path = ckpt.Saver({k: ckpt.Variable(v, name=k) for k, v in tensors}, compression=compression) \
        .save(str(tmp_path / f"m.{ext}")) if compression else _save(str(tmp_path / f"m.{ext}"), model)
    order = list(model)
    np.random.default_rng(3).shuffle(order)
    fresh = _fresh(model)
    result = ckpt.Saver({k: fresh[k] for k in order}).restore(path)
    assert sorted(result.restored) == sorted(model) and result.missing == [] and result.unexpected == []
    for key, value in model.items():
        assert_bit_exact(value, np.asarray(fresh[key].value(), dtype=value.dtype))  # (0-d strings: bytes)


def test_damaged_bytes_in_one_small_tensor_name_its_key_and_file(tmp_path, ext):
    model = _model(300)
    path = _save(str(tmp_path / f"m.{ext}"), model)
    _damage(path, model["layer123/w"])
    fresh = _fresh(model)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"(?s)m\.(msgpack|h5).*'layer123/w'.*checksum") as info:
        ckpt.Saver(fresh).restore(path)
    assert info.value.key == "layer123/w" and info.value.path == path
    assert "restore stopped" in str(info.value)
    # all or nothing: every variable is either uninitialized (listed) or untouched
    for key, var in fresh.items():
        assert (f"fresh/{key}:0" in str(info.value)) != var.is_initialized()
        if var.is_initialized():
            np.testing.assert_array_equal(var.numpy(), np.full(256, 9, np.float32))
    assert not fresh["layer123/w"].is_initialized()


def test_shape_and_dtype_mismatches_are_reported_together_and_change_nothing(tmp_path, ext):
    model = _model(200)
    path = _save(str(tmp_path / f"m.{ext}"), model)
    fresh = _fresh(model)
    fresh["layer007/w"] = ckpt.Variable(np.zeros((16, 16), np.float32), name="odd_shape")
    fresh["layer150/w"] = ckpt.Variable(np.zeros(256, np.float64), name="odd_dtype")
    with pytest.raises(ckpt.MismatchError) as info:
        ckpt.Saver(fresh).restore(path)
    message = str(info.value)
    assert "2 problems" in message and "no variable was changed" in message and path in message
    assert "layer007/w: shape (16, 16) in the model, (256,)" in message
    assert "layer150/w: dtype float64 in the model, float32" in message
    for var in fresh.values():
        assert not np.any(var.numpy() == model["layer000/w"][0])  # still the values it had
    # the dtype the assign rule converts: restored through the plan, cast
    del fresh["layer007/w"]
    ckpt.Saver(fresh).restore(path, allow_cast=True)
    np.testing.assert_array_equal(fresh["layer150/w"].numpy(), model["layer150/w"].astype(np.float64))
    assert_bit_exact(model["layer151/w"], fresh["layer151/w"].numpy())


def test_partial_restores_report_the_rest(tmp_path, ext):
    model = _model(120)
    path = _save(str(tmp_path / f"m.{ext}"), model)
    some = list(model)[5::7]  # far apart in the file
    fresh = _fresh(model)
    result = ckpt.Saver({k: fresh[k] for k in some}).restore(path)
    assert result.restored == some and result.missing == []
    assert result.unexpected == [k for k in model if k not in some]
    for key, var in fresh.items():
        expected = model[key] if key in some else np.full(256, 9, np.float32)
        assert_bit_exact(expected, var.numpy())
    extra = ckpt.Variable(np.zeros(3, np.float32), name="extra")
    result = ckpt.Saver({**{k: fresh[k] for k in some}, "not/in/file": extra}).restore(path, strict=False)
    assert result.missing == ["not/in/file"] and result.restored == some
    assert np.all(extra.numpy() == 0)


def test_deferred_variables_get_their_buffers_only_when_everything_matches(tmp_path, ext):
    model = _model(20)
    path = _save(str(tmp_path / f"m.{ext}"), model)
    with ckpt.deferred_init():
        deferred = {k: ckpt.Variable(ckpt.initializers.Zeros(), shape=(256,), name=f"d/{k}") for k in model}
    ckpt.Saver(deferred).restore(path)
    for key, var in deferred.items():
        assert var.is_initialized()
        assert_bit_exact(model[key], var.numpy())


def test_batch_bounds_cut_where_read_in_batches_does():
    class Local:
        path = "model.msgpack"

    sizes = [60 * MiB, 10 * MiB, 1024, 64 * MiB, 0, 0, 3 * MiB, 70 * MiB, 5]
    assert batch_bounds(Local(), sizes) == [(0, 2), (2, 4), (4, 8), (8, 9)]
    assert batch_bounds(Local(), []) == []
    assert batch_bounds(Local(), [1024] * 10) == [(0, 10)]
