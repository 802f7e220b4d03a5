"""Round-trip property: random sets of variables come back bit-exact through both formats and
through ``ckpt convert`` (both directions), with their metadata.

Keys mix scopes and non-ASCII names; every dtype; shapes include 0-d and empty; numeric
values are arbitrary bit patterns (NaN payloads, subnormals, negative zero), byte strings
hold NULs (trailing ones too). Hypothesis runs derandomized, so the suite is deterministic.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
from click.testing import CliRunner
from conftest import every_dtype_tensors
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reliability_support import equal_tensors

import ckpt
from ckpt.cli import main as cli_main
from ckpt.formats.base import key_problem

EXAMPLES = 60  # x --reliability-scale
NAME_CHARS = st.sampled_from(list("abcxyz019_-. ") + ["é", "日", "Ω", "\u00a0"])
PART = st.text(NAME_CHARS, min_size=1, max_size=6).filter(lambda p: not key_problem(p))
KEY = st.lists(PART, min_size=1, max_size=3).map("/".join)
SHAPE = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def tensor(draw, dtype_name: str | None = None) -> np.ndarray:
    name = draw(st.sampled_from(ckpt.dtypes.NAMES)) if dtype_name is None else dtype_name
    dtype = ckpt.dtypes.as_dtype(name)
    shape = draw(SHAPE)
    count = int(np.prod(shape, dtype=np.int64))
    if name == "string":
        items = draw(st.lists(st.binary(max_size=12), min_size=count, max_size=count))
        out = np.empty(count, dtype=object)
        out[:] = items
        return out.reshape(shape)
    if name == "bool":
        return np.array(draw(st.lists(st.booleans(), min_size=count, max_size=count)), dtype=bool).reshape(shape)
    raw = draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()  # every bit pattern, NaN payloads too


METADATA = st.dictionaries(
    st.text(max_size=8),
    st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 63), 2 ** 63 - 1), st.floats(allow_nan=False),
              st.text(max_size=10), st.lists(st.integers(-5, 5), max_size=3)),
    max_size=4)


@st.composite
def checkpoint(draw) -> tuple[dict[str, np.ndarray], dict]:
    keys = draw(st.lists(KEY, min_size=1, max_size=6, unique=True))  # "a" beside "a/b" included
    return {key: draw(tensor()) for key in keys}, draw(METADATA)


def blank_like(value: np.ndarray) -> np.ndarray:
    return np.full(value.shape, b"", dtype=object) if value.dtype.kind == "O" else np.zeros_like(value)


def check_file(path: str, tensors: dict[str, np.ndarray], metadata: dict) -> None:
    """Read ``path`` back two ways (a restore into fresh variables, a reader) and compare."""
    fresh = {key: ckpt.Variable(blank_like(value)) for key, value in tensors.items()}
    result = ckpt.Saver(fresh).restore(path)
    assert sorted(result.restored) == sorted(tensors) and not result.unexpected
    with ckpt.load_checkpoint(path) as reader:
        assert reader.verify() == []
        assert reader.metadata == metadata
        assert set(reader.tensors) == set(tensors)
        for key, value in tensors.items():
            assert equal_tensors(value, reader.get_tensor(key)), (path, key)
            assert equal_tensors(value, np.asarray(fresh[key].value())), (path, key)


def test_random_checkpoints_round_trip_bit_exactly(reliability_scale):
    runner = CliRunner()

    @settings(max_examples=EXAMPLES * reliability_scale, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(checkpoint())
    @example((dict(every_dtype_tensors()), {"step": 2 ** 63 - 1, "name": "é", "nested": {"a": [1, None]}}))
    def round_trip(case):
        tensors, metadata = case
        directory = tempfile.mkdtemp(prefix="ckpt-roundtrip-")
        try:
            variables = {key: ckpt.Variable(value) for key, value in tensors.items()}
            saver = ckpt.Saver(variables, max_to_keep=None)
            for ext, other in ((".h5", ".msgpack"), (".msgpack", ".h5")):
                path = saver.save(os.path.join(directory, "model" + ext), metadata=metadata)
                check_file(path, tensors, metadata)
                converted = os.path.join(directory, "converted" + other)
                result = runner.invoke(cli_main, ["convert", path, converted])
                assert result.exit_code == 0, (result.output, result.exception)
                check_file(converted, tensors, metadata)
        finally:
            shutil.rmtree(directory)

    round_trip()
