"""Shared fixtures: sample tensors of every dtype and bit-exact comparison."""

from __future__ import annotations

import pathlib
import sys
import tempfile

import numpy as np
import pytest

import ckpt
import s3server  # noqa: F401  # sets moto's minimum part size before any test module imports moto

# Child Pythons run from here: started in the checkout, "python -c" would import its source ckpt/
# (with formats/ and cli/ beside it, ckpt/_sourcetree.py) instead of the installed package under test.
OUTSIDE_CHECKOUT = tempfile.gettempdir()
#: tests/ (where the fixtures, the support modules and the child scripts live) and the repository root:
#: test modules sit in subfolders by package (unit/<package>/) and by system (system/<suite>/)
TESTS = str(pathlib.Path(__file__).resolve().parent)
ROOT = str(pathlib.Path(TESTS).parent)
# some suites build their cases with another suite's builders (reliability_foreign with the foreign
# suites' file writers, s3_mpi with test_mpi's runner): every suite folder is importable, whichever
# files a run selects
sys.path[:0] = [str(p) for p in sorted(pathlib.Path(TESTS).glob("*/**/")) if p.name != "__pycache__"
                and not p.is_relative_to(pathlib.Path(TESTS) / "fixtures") and str(p) not in sys.path]


def every_dtype_tensors() -> list[tuple[str, np.ndarray]]:
    """One tensor per supported dtype, plus 0-d, empty and awkward values."""
    rng = np.random.default_rng(0)
    out = []
    for name in ckpt.dtypes.NAMES:
        dtype = ckpt.dtypes.as_dtype(name)
        if name == "string":
            value = np.array([[b"abc", b"", b"nul\x00"], [b"\x00\x00", b"\xff\xfe", b"x" * 40]], dtype=object)
        elif name == "bool":
            value = rng.random((2, 3)) > 0.5
        elif name.startswith("complex"):
            value = (rng.standard_normal((2, 3)) + 1j * rng.standard_normal((2, 3))).astype(dtype)
        elif name.startswith(("int", "uint")):
            info = np.iinfo(dtype)
            value = np.array([[info.min, info.max, 0], [1, 2, 3]], dtype=dtype)
        else:
            value = rng.standard_normal((2, 3)).astype(dtype)
        out.append((f"dtypes/{name}", value))
    nan_payload = np.array([0x7FC00001, 0xFF800000, 0x00000001], dtype=np.uint32).view(np.float32)
    out += [
        ("shapes/scalar", np.array(3.5, dtype=np.float32)),
        ("shapes/scalar_string", np.array(b"only", dtype=object)),
        ("shapes/empty", np.zeros((0, 4), dtype=np.float64)),
        ("shapes/empty_string", np.empty((0,), dtype=object)),
        ("shapes/rank4", np.arange(2 * 3 * 4 * 5, dtype=np.int16).reshape(2, 3, 4, 5)),
        ("values/nan_payloads", nan_payload),
        ("values/bf16_specials", np.array([np.inf, -np.inf, np.nan, -0.0], dtype=ckpt.dtypes.bfloat16)),
    ]
    return out


def assert_bit_exact(expected: np.ndarray, actual: np.ndarray) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.dtype.kind == "O":
        assert actual.tolist() == expected.tolist()
        assert all(type(x) is bytes for x in actual.reshape(-1))
    else:
        assert expected.tobytes() == actual.tobytes()


def data_offset(path, value: np.ndarray) -> int:
    """Where ``value``'s bytes sit in the file (found by content: independent of any index)."""
    raw = pathlib.Path(path).read_bytes()
    offset = raw.find(value.tobytes())
    assert offset > 0 and raw.find(value.tobytes(), offset + 1) == -1, "tensor bytes must be unique"
    return offset


@pytest.fixture
def tensors() -> list[tuple[str, np.ndarray]]:
    return every_dtype_tensors()


@pytest.fixture(params=["hdf5", "msgpack"])
def fmt(request):
    from ckpt.formats import base

    return base.get_format(request.param)


# --- reliability suite (tests/test_reliability_*.py): count multiplier for long runs -------------
def pytest_addoption(parser):
    parser.addoption("--reliability-scale", type=int, default=None, metavar="N",
                     help="multiply the reliability tests' counts (kills, bit flips, fuzz examples) "
                          "by N; also read from the CKPT_FUZZ_SCALE environment variable")


def pytest_configure(config):
    import os

    value = config.getoption("--reliability-scale", default=None)
    if value is not None:
        os.environ["CKPT_FUZZ_SCALE"] = str(max(1, value))  # child processes inherit it


@pytest.fixture
def reliability_scale() -> int:
    """The reliability tests' count multiplier (1 by default)."""
    from reliability_support import scale

    return scale()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (free port), with AWS_* variables pointing at it."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from s3server import S3Server

    server = S3Server()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket on the test S3 server: its URL, "s3://ckpt-test-N"."""
    import uuid

    import boto3

    name = f"ckpt-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    s3_server.traffic.clear()
    return f"s3://{name}"
