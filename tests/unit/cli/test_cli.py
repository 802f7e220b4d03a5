"""The ``ckpt`` command line: every command, option, exit code and error message."""

from __future__ import annotations

import pathlib
import io
import json
import os
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_bit_exact, every_dtype_tensors, OUTSIDE_CHECKOUT, TESTS

import ckpt
from ckpt.storage.atomic import replace_atomically
from ckpt.cli import main, progress
from ckpt.tools.comparison import compare_values
from ckpt.cli.ls_cmd import human_size
from ckpt.formats import base
from ckpt.storage.state import CheckpointEntry, CheckpointState, write_state

SAMPLES = os.path.join(TESTS, os.pardir, "sample_checkpoints")
#: A float32 whose bytes are easy to find in a file, to damage a tensor's data.
MARK = np.float32(1234.5678)


def run(*args: object):
    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:  # click >= 8.2 always keeps stderr apart
        runner = CliRunner()
    return runner.invoke(main, [str(a) for a in args], prog_name="ckpt", catch_exceptions=False)


def save(path, tensors: dict, metadata: dict | None = None) -> str:
    """Write a checkpoint file in the format of its extension (no state file)."""
    path = str(path)
    with replace_atomically(path) as tmp:
        base.format_for_path(path).write(tmp, list(tensors.items()), metadata or {})
    return path


def model(**extra) -> dict:
    return {"enc/kernel": np.arange(6, dtype=np.float32).reshape(2, 3), "enc/bias": np.zeros(3, np.float32),
            "dec/w": np.full((2, 2), MARK), **extra}


def damage(path: str) -> None:
    """Flip one bit inside dec/w's data (filled with MARK)."""
    with open(path, "r+b") as f:
        data = f.read()
        offset = data.index(MARK.tobytes()) + 1
        f.seek(offset)
        f.write(bytes([data[offset] ^ 1]))


@pytest.fixture
def ext(fmt) -> str:
    return fmt.extensions[0]


# -- the group -------------------------------------------------------------------------------

def test_help_lists_every_command():
    result = run("--help")
    assert result.exit_code == 0
    for command in ("inspect", "diff", "convert", "verify", "ls"):
        assert f"  {command} " in result.stdout


def test_version():
    result = run("--version")
    assert result.exit_code == 0 and ckpt.__version__ in result.stdout


def test_help_shows_each_commands_own_one_line_help():
    """`ckpt --help` lists commands without importing them; its lines must be theirs."""
    from ckpt.cli.main import COMMANDS

    for name, (_, line) in COMMANDS.items():
        assert main.get_command(None, name).get_short_help_str(200) == line
    assert sorted(main.list_commands(None)) == sorted(COMMANDS)


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["inspect", "--help"]])
def test_version_and_help_start_without_numpy_h5py_or_formats(args):
    """Measured with the modules a fresh interpreter has loaded, not with a clock."""
    code = (f"import sys\nfrom ckpt.cli import main\ntry:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
            "heavy = ('numpy', 'h5py', 'msgpack', 'ml_dtypes', 'crc32c', 'ckpt.formats')\n"
            "print(sorted(m for m in sys.modules if m.startswith(heavy)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=OUTSIDE_CHECKOUT)
    loaded = out.stdout.strip().splitlines()[-1]
    if args[0] == "inspect":  # a command's help needs its module (numpy), never the formats or h5py
        assert "h5py" not in loaded and "ckpt.formats" not in loaded, loaded
    else:
        assert loaded == "[]", loaded


def test_unknown_command_is_a_one_line_usage_error():
    result = run("inspekt", "m.h5")
    assert result.exit_code == 2
    assert result.stderr == "Error: No such command 'inspekt'. Did you mean 'inspect'? (see 'ckpt --help')\n"
    assert result.stdout == ""


def test_missing_argument_is_a_one_line_usage_error():
    result = run("inspect")
    assert result.exit_code == 2
    assert result.stderr == "Error: Missing argument 'PATH'. (see 'ckpt inspect --help')\n"


def test_unexpected_exceptions_are_one_line_not_a_traceback(tmp_path, monkeypatch):
    path = save(tmp_path / "m.h5", model())

    def broken(self, key):
        raise RuntimeError("boom")

    monkeypatch.setattr(ckpt.CheckpointReader, "get_tensor", broken)
    result = run("inspect", path, "--tensor", "dec/w")
    assert result.exit_code == 1
    assert result.stderr == "Error: unexpected RuntimeError: boom (this is a bug; please report it)\n"


# -- inspect ---------------------------------------------------------------------------------

def test_inspect_lists_tensors_sorted_with_the_parameter_count(tmp_path, ext):
    path = save(tmp_path / f"m{ext}", model())
    result = run("inspect", path)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ("tensor: dec/w (float32) [2, 2]\n"
                             "tensor: enc/bias (float32) [3]\n"
                             "tensor: enc/kernel (float32) [2, 3]\n"
                             "# Total number of params: 13\n")
    assert result.stderr == ""


def test_inspect_counts_a_scalar_as_one_and_strings_by_element(tmp_path, ext):
    path = save(tmp_path / f"m{ext}", {"step": np.array(7, np.int64),
                                       "vocab": np.array([b"a", b"bb", b""], dtype=object),
                                       "empty": np.zeros((0, 5), np.float32)})
    assert run("inspect", path).stdout.splitlines()[-1] == "# Total number of params: 4"


def test_inspect_a_directory_means_its_latest_checkpoint(tmp_path):
    v = ckpt.Variable([1.0, 2.0], name="v")
    saver = ckpt.Saver({"v": v}, max_to_keep=None)
    saver.save(tmp_path / "model.h5", global_step=1)
    latest = saver.save(tmp_path / "model.msgpack", global_step=2)
    result = run("inspect", tmp_path, "--tensor", "v", "--json")
    assert json.loads(result.stdout)["path"] == latest


def test_listing_reads_no_tensor_data(tmp_path, ext):
    path = save(tmp_path / f"m{ext}", model())
    damage(path)
    assert run("inspect", path).exit_code == 0
    assert run("inspect", path, "--names-only").exit_code == 0
    result = run("inspect", path, "--tensor", "dec/w")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "'dec/w' fails its checksum" in result.stderr


def test_inspect_tensor_prints_its_values(tmp_path, ext):
    path = save(tmp_path / f"m{ext}", model())
    result = run("inspect", path, "--tensor", "enc/kernel")
    assert result.exit_code == 0
    assert result.stdout == ("tensor: enc/kernel (float32) [2, 3]\n"
                             f"{np.arange(6, dtype=np.float32).reshape(2, 3)}\n"
                             "# Total number of params: 13\n")


def test_inspect_tensor_accepts_a_variable_name(tmp_path):
    path = save(tmp_path / "m.h5", model())
    assert run("inspect", path, "--tensor", "enc/bias:0").stdout.startswith("tensor: enc/bias (float32) [3]\n")


def test_inspect_unknown_tensor_names_the_closest_keys(tmp_path):
    path = save(tmp_path / "m.h5", model())
    result = run("inspect", path, "--tensor", "enc/kernal")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == (f"Error: Tensor enc/kernal not found in checkpoint {path}\n"
                             "  closest keys: enc/kernel, enc/bias\n")


def test_printoptions_in_tensorflows_form_and_repeated(tmp_path):
    path = save(tmp_path / "m.h5", {"x": np.linspace(0, 1, 30, dtype=np.float64)})
    expected = np.array2string(np.linspace(0, 1, 30), precision=2, threshold=10, edgeitems=2)
    for args in (["--printoptions", "precision=2", "threshold=10", "edgeitems=2"],
                 ["--printoptions", "precision=2 threshold=10", "--printoptions", "edgeitems=2"],
                 ["--printoptions=precision=2", "threshold=10", "edgeitems=2"]):
        result = run("inspect", path, "--tensor", "x", *args)
        assert result.exit_code == 0, result.stderr
        assert result.stdout.splitlines()[1:-1] == expected.splitlines()
    # options apply to this command only
    assert np.get_printoptions()["precision"] == 8


def test_printoptions_before_the_path(tmp_path):
    path = save(tmp_path / "m.h5", {"x": np.array([1 / 3])})
    result = run("inspect", "--printoptions", "precision=3", "suppress=true", path, "--tensor", "x")
    assert result.stdout.splitlines()[1] == "[0.333]"


@pytest.mark.parametrize("option, message", [
    ("precision", "'precision' is not in the form name=value"),
    ("colour=red", "'colour' is not a numpy print option that can be set here"),
    ("formatter=x", "'formatter' is not a numpy print option that can be set here"),
    ("precision=high", "precision=high: expected an integer"),
    ("suppress=maybe", "suppress=maybe: expected true or false"),
    ("floatmode=wobbly", "floatmode"),
])
def test_a_bad_printoption_is_a_usage_error(tmp_path, option, message):
    path = save(tmp_path / "m.h5", model())
    result = run("inspect", path, "--tensor", "enc/bias", "--printoptions", option)
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: Invalid value for --printoptions: ")
    assert message in result.stderr and result.stderr.count("\n") == 1


def test_inspect_all_tensors(tmp_path, ext):
    path = save(tmp_path / f"m{ext}", model())
    result = run("inspect", path, "--all-tensors")
    assert result.stdout == ("tensor: dec/w (float32) [2, 2]\n"
                             f"{np.full((2, 2), MARK)}\n"
                             "tensor: enc/bias (float32) [3]\n"
                             "[0. 0. 0.]\n"
                             "tensor: enc/kernel (float32) [2, 3]\n"
                             f"{np.arange(6, dtype=np.float32).reshape(2, 3)}\n"
                             "# Total number of params: 13\n")


def test_inspect_names_only(tmp_path):
    path = save(tmp_path / "m.msgpack", model())
    assert run("inspect", path, "--names-only").stdout == "dec/w\nenc/bias\nenc/kernel\n"


def test_inspect_exclude_leaves_keys_out_of_the_count(tmp_path):
    path = save(tmp_path / "m.h5", model())
    result = run("inspect", path, "--exclude", "^enc/")
    assert result.stdout.splitlines()[-2:] == [
        "# Excluding 2 tensors (9 params) that match ^enc/ when counting.",
        "# Total number of params: 4"]
    assert result.stdout.count("tensor: ") == 3  # listed all the same


@pytest.mark.parametrize("args, message", [
    (["--exclude", "("], "Error: Invalid value for --exclude: '(' is not a regular expression"),
    (["--tensor", "dec/w", "--all-tensors"], "Error: --tensor and --all-tensors cannot be used together"),
    (["--names-only", "--stats"], "Error: --names-only cannot be combined with"),
    (["--names-only", "--all-tensors"], "Error: --names-only cannot be combined with"),
    (["--bogus"], "Error: No such option"),
])
def test_inspect_usage_errors(tmp_path, args, message):
    path = save(tmp_path / "m.h5", model())
    result = run("inspect", path, *args)
    assert result.exit_code == 2
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1
    assert result.stdout == ""


def test_inspect_stats(tmp_path, ext):
    values = np.array([[0.0, 1.0, 2.0], [3.0, np.nan, np.inf]], np.float32)
    path = save(tmp_path / f"m{ext}", {"a": values, "b": np.arange(4, dtype=np.int8)})
    result = run("inspect", path, "--stats")
    assert result.exit_code == 0
    finite = np.array([0.0, 1.0, 2.0, 3.0])
    assert result.stdout.splitlines() == [
        "tensor: a (float32) [2, 3]",
        f"  min 0  max 3  mean 1.5  std {finite.std():.6g}  zeros 16.7%  nan 1  inf 1  <- NaN/Inf",
        "  histogram 0 |█   █   █   █   | 4",  # bins of 0.25 from 0: [0, 0.25), ... [3.75, 4)
        "tensor: b (int8) [4]",
        f"  min 0  max 3  mean 1.5  std {finite.std():.6g}  zeros 25.0%",
        "  histogram 0 |████            | 16",  # integers: bins of 1 at least
        "# Tensors with NaN or Inf: 1 (a)",
        "# Total number of params: 10",
    ]


def test_inspect_stats_on_every_dtype(tmp_path, ext):
    path = save(tmp_path / f"m{ext}", dict(every_dtype_tensors()))
    result = run("inspect", path, "--stats")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[lines.index("tensor: dtypes/bool (bool) [2, 3]") + 1].startswith("  true ")
    assert lines[lines.index("tensor: dtypes/string (string) [2, 3]") + 1] == \
        "  lengths: min 0  max 40  empty 16.7%"
    assert lines[lines.index("tensor: shapes/empty (float64) [0, 4]") + 1] == "  empty: no values"
    assert "# Tensors with NaN or Inf: 2 (values/bf16_specials, values/nan_payloads)" in lines


def test_inspect_json(tmp_path, ext):
    path = save(tmp_path / f"m{ext}", model(), metadata={"step": 3})
    doc = json.loads(run("inspect", path, "--json").stdout)
    assert doc["path"] == path and doc["format"] == base.format_for_path(path).name
    assert doc["metadata"] == {"step": 3}
    assert [t["key"] for t in doc["tensors"]] == ["dec/w", "enc/bias", "enc/kernel"]
    assert doc["tensors"][2] == {"key": "enc/kernel", "dtype": "float32", "shape": [2, 3], "size": 6, "nbytes": 24}
    assert doc["params"] == {"total": 13, "excluded_tensors": 0, "excluded_params": 0, "exclude": None}


def test_inspect_json_with_values_stats_and_exclude(tmp_path):
    path = save(tmp_path / "m.h5", {"x": np.array([1.0, np.nan, -np.inf]), "s": np.array([b"ok", b"\xff"], object)})
    doc = json.loads(run("inspect", path, "--json", "--all-tensors", "--stats", "--exclude", "^s$").stdout)
    s, x = doc["tensors"]
    assert x["values"] == [1.0, "NaN", "-Infinity"]
    assert x["stats"]["nan"] == 1 and x["stats"]["inf"] == 1 and x["stats"]["min"] == 1.0
    assert s["values"] == ["ok", "\\xff"] and s["stats"]["kind"] == "string"
    assert doc["nonfinite_tensors"] == ["x"]
    assert doc["params"]["excluded_tensors"] == 1 and doc["params"]["total"] == 3


def test_inspect_json_names_only(tmp_path):
    path = save(tmp_path / "m.h5", model())
    assert json.loads(run("inspect", path, "--json", "--names-only").stdout) == {
        "path": path, "format": "hdf5", "keys": ["dec/w", "enc/bias", "enc/kernel"]}


@pytest.mark.parametrize("content, message", [
    (None, "no such checkpoint file"),
    (b"", "an empty file"),
    (b"definitely not a checkpoint", "not a checkpoint in any supported format"),
])
def test_inspect_unreadable_files(tmp_path, content, message):
    path = tmp_path / "m.h5"
    if content is not None:
        path.write_bytes(content)
    result = run("inspect", path)
    assert result.exit_code == 1
    assert result.stderr == f"Error: {path}: {message}" + result.stderr.split(message, 1)[1]
    assert result.stderr.count("\n") == 1


def test_inspect_truncated_file(tmp_path, ext):
    path = save(tmp_path / f"m{ext}", model())
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    result = run("inspect", path)
    assert result.exit_code == 1 and result.stderr.startswith(f"Error: {path}: ")


def test_inspect_directory_without_checkpoints(tmp_path):
    result = run("inspect", tmp_path)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {tmp_path}: no checkpoint in this directory")


# -- diff ------------------------------------------------------------------------------------

def test_diff_same_checkpoint_in_two_formats(tmp_path):
    a = save(tmp_path / "a.h5", dict(every_dtype_tensors()))
    b = save(tmp_path / "b.msgpack", dict(every_dtype_tensors()))
    result = run("diff", a, b)
    assert result.exit_code == 0, result.stdout
    assert result.stdout == f"--- {a}\n+++ {b}\n# same: {len(every_dtype_tensors())} identical\n"


def test_diff_reports_every_kind_of_difference(tmp_path):
    a = save(tmp_path / "a.h5", {"gone": np.zeros(2), "dtype": np.zeros(3, np.float32), "shape": np.zeros(3),
                                 "vals": np.array([1.0, 2.0, 4.0]), "same": np.ones(2), "s": np.array([b"x"], object)})
    b = save(tmp_path / "b.h5", {"new": np.zeros(2), "dtype": np.array([0, 0, 1], np.float64), "shape": np.zeros(4),
                                 "vals": np.array([1.0, 2.5, 0.0]), "same": np.ones(2), "s": np.array([b"y"], object)})
    result = run("diff", a, b)
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        f"--- {a}",
        f"+++ {b}",
        "! dtype: (float32) [3] -> (float64) [3]; 1 of 3 values differs (max abs diff 1, max rel diff 1, rel L2 change inf)",
        "- gone (float64) [2]",
        "+ new (float64) [2]",
        "! s (string) [1]: 1 of 1 value differs",
        "! shape: (float64) [3] -> (float64) [4]",
        "! vals (float64) [3]: 2 of 3 values differ (max abs diff 4, max rel diff inf, rel L2 change 0.879664)",
        "# different: 1 only in A, 1 only in B, 2 changed dtype or shape, 2 differ, 1 identical",
    ]


def test_diff_tolerances(tmp_path):
    a = save(tmp_path / "a.h5", {"w": np.array([1.0, 100.0, np.nan])})
    b = save(tmp_path / "b.h5", {"w": np.array([1.001, 100.5, np.nan])})
    assert run("diff", a, b).exit_code == 1
    assert run("diff", a, b, "--atol", "0.1").exit_code == 1  # 0.5 apart at 100
    result = run("diff", a, b, "--atol", "0.01", "--rtol", "0.01")
    assert result.exit_code == 0
    assert result.stdout.splitlines()[2:] == [
        "~ w (float64) [3]: 2 of 3 values differ, within tolerance (max abs diff 0.5, max rel diff 0.00497512, rel L2 change 0.00499976)",
        "# same: 1 within tolerance"]


def test_diff_trouble_exits_2(tmp_path):
    a = save(tmp_path / "a.h5", model())
    result = run("diff", a, tmp_path / "missing.h5")
    assert result.exit_code == 2
    assert result.stderr == f"Error: {tmp_path / 'missing.h5'}: no such checkpoint file\n"
    result = run("diff", a, a, "--rtol", "-1")
    assert result.exit_code == 2 and result.stderr.startswith("Error: Invalid value for '--rtol'")
    result = run("diff", a)
    assert result.exit_code == 2 and result.stderr.startswith("Error: Missing argument 'B'")


def test_compare_values_edge_cases():
    inf, nan = np.inf, np.nan
    vd = compare_values(np.array([inf, -inf, nan, 0.0, 1.0]), np.array([inf, -inf, nan, 0.0, nan]))
    assert (vd.unequal, vd.outside, vd.max_abs) == (1, 1, inf)  # NaN against a number
    vd = compare_values(np.array([-inf]), np.array([inf]), atol=1e300, rtol=1.0)
    assert vd.outside == 1  # opposite infinities are never close
    vd = compare_values(np.array([1.0]), np.array([0.0]))
    assert vd.max_rel == inf
    vd = compare_values(np.array([2**62 + 1], np.int64), np.array([2**62], np.int64))
    assert vd.unequal == 1  # exact for integers beyond float64's precision
    vd = compare_values(np.array([1 + 1j]), np.array([1 - 1j]), atol=1.0)
    assert (vd.unequal, vd.outside, vd.max_abs) == (1, 1, 2.0)


def test_compare_values_in_chunks():
    a, b = np.arange(10.0), np.arange(10.0)
    b[[1, 8]] += [0.5, -2.0]
    vd = compare_values(a, b, step=3)
    assert (vd.count, vd.unequal, vd.max_abs) == (10, 2, 2.0)


# -- convert ---------------------------------------------------------------------------------

@pytest.mark.parametrize("src_ext, dst_ext", [(".h5", ".msgpack"), (".msgpack", ".h5"), (".h5", ".hdf5")])
def test_convert_keeps_every_tensor_bit_for_bit_and_the_metadata(tmp_path, src_ext, dst_ext):
    tensors = every_dtype_tensors()
    src = save(tmp_path / f"src{src_ext}", dict(tensors), metadata={"step": 7, "tags": ["a"]})
    dst = str(tmp_path / f"dst{dst_ext}")
    result = run("convert", src, dst)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == (f"{dst} ({base.format_for_path(dst).name}): {len(tensors)} tensors from {src} "
                             f"({base.format_for_path(src).name}); read back and checked\n")
    with ckpt.load_checkpoint(dst) as reader:
        assert reader.metadata == {"step": 7, "tags": ["a"]}
        assert sorted(reader.tensors) == sorted(k for k, _ in tensors)
        for key, value in tensors:
            assert_bit_exact(value, reader.get_tensor(key))


def test_convert_keys_and_scope_renames(tmp_path):
    src = save(tmp_path / "src.h5", {"enc/w": np.ones(2), "enc/b": np.zeros(2), "encoder/x": np.ones(1),
                                     "head/w": np.ones(3), "model/top/v": np.ones(1)})
    dst = tmp_path / "dst.msgpack"
    result = run("convert", src, dst, "--keys", "^(enc|model)/", "--rename", "enc=encoder/layer0",
                 "--rename", "model/=")
    assert result.exit_code == 0, result.stderr
    assert "3 tensors" in result.stdout and "3 renamed" in result.stdout
    # "enc" renames the scope enc/, not encoder/ (which --keys left out anyway)
    assert ckpt.list_variables(dst) == [("encoder/layer0/b", [2]), ("encoder/layer0/w", [2]), ("top/v", [1])]


def test_convert_in_place(tmp_path):
    path = save(tmp_path / "m.h5", model())
    refused = run("convert", path, path, "--rename", "dec=decoder")
    assert refused.exit_code == 2 and "exists; pass --force to replace it" in refused.stderr
    assert run("convert", path, path, "--rename", "dec=decoder", "--force").exit_code == 0
    assert [k for k, _ in ckpt.list_variables(path)] == ["decoder/w", "enc/bias", "enc/kernel"]


def test_convert_a_directory_takes_its_latest(tmp_path):
    saver = ckpt.Saver({"v": ckpt.Variable(3.0)})
    saver.save(tmp_path / "m.h5", global_step=4)
    saver.save(tmp_path / "m.h5", global_step=5)
    result = run("convert", tmp_path, tmp_path / "out.msgpack")
    assert result.exit_code == 0 and f"from {tmp_path / 'm-5.h5'} (hdf5)" in result.stdout
    assert ckpt.load_variable(tmp_path / "out.msgpack", "v") == 3.0


@pytest.mark.parametrize("args, message", [
    (["out.txt"], "Error: Invalid value for DST: cannot tell a checkpoint format from the extension of 'out.txt'"),
    (["out.h5", "--keys", "("], "Error: Invalid value for --keys: '(' is not a regular expression"),
    (["out.h5", "--rename", "enc"], "Error: Invalid value for --rename: 'enc' is not in the form OLD=NEW"),
    (["out.h5", "--rename", "=x"], "Error: Invalid value for --rename: '=x' is not in the form OLD=NEW"),
    (["out.h5", "--rename", "a=b", "--rename", "a/=c"], "Error: Invalid value for --rename: 'a' is renamed twice"),
    (["out.h5", "--rename", "enc/bias=enc/kernel"],
     "Error: Invalid value for --rename: 'enc/kernel' and 'enc/bias' would both become 'enc/kernel'"),
])
def test_convert_usage_errors(tmp_path, monkeypatch, args, message):
    src = save(tmp_path / "src.h5", {"enc/kernel": np.ones(2), "enc/bias": np.ones(2), "dec": np.ones(1)})
    monkeypatch.chdir(tmp_path)
    result = run("convert", src, *args)
    assert result.exit_code == 2
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["src.h5"]


def test_convert_into_a_read_only_format_is_a_usage_error(tmp_path):
    class ReadOnly(base.Format):
        name, extensions, can_write = "readonly", (".ro",), False

        def sniff(self, head):
            return False

        def open(self, path, blob=None, declined=None):
            raise NotImplementedError

    base.register_format(ReadOnly())
    try:
        src = save(tmp_path / "src.h5", model())
        result = run("convert", src, tmp_path / "out.ro")
    finally:
        base.unregister_format("readonly")
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: Invalid value for DST: the readonly format can be read but not written;"
                                    " write one of .h5/.hdf5 (hdf5), .msgpack (msgpack)")
    assert ".ro" not in result.stderr.split("write one of")[1]


@pytest.mark.parametrize("args, message", [
    (["--keys", "^nothing"], "no tensor key matches --keys '^nothing'"),
    (["--rename", "encoder=x"], "--rename encoder=...: no tensor key is 'encoder' or under 'encoder/'"),
])
def test_convert_key_problems_exit_1(tmp_path, args, message):
    src = save(tmp_path / "src.h5", model())
    result = run("convert", src, tmp_path / "out.h5", *args)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {src}: {message}")
    assert not (tmp_path / "out.h5").exists()


def test_convert_rename_not_found_names_the_closest_scope(tmp_path):
    src = save(tmp_path / "src.h5", model())
    result = run("convert", src, tmp_path / "out.h5", "--rename", "encc=x")
    assert result.stderr.splitlines()[1] == "  closest keys: enc, dec"


def test_convert_missing_source_or_destination_directory(tmp_path):
    result = run("convert", tmp_path / "none.h5", tmp_path / "out.h5")
    assert result.exit_code == 1 and result.stderr == f"Error: {tmp_path / 'none.h5'}: no such checkpoint file\n"
    src = save(tmp_path / "src.h5", model())
    result = run("convert", src, tmp_path / "no" / "out.h5")  # missing directories are created
    assert result.exit_code == 0, result.output
    assert ckpt.list_variables(tmp_path / "no" / "out.h5") == ckpt.list_variables(src)
    (tmp_path / "file").write_text("")
    result = run("convert", src, tmp_path / "file" / "out.h5")
    assert result.exit_code == 1 and "cannot create the directory" in result.stderr


def test_convert_that_does_not_read_back_leaves_dst_untouched(tmp_path, monkeypatch):
    src = save(tmp_path / "src.h5", model())
    dst = save(tmp_path / "dst.msgpack", {"old": np.ones(1)})
    fmt = base.get_format("msgpack")
    write = fmt.write_blob
    monkeypatch.setattr(fmt, "write_blob", lambda blob, tensors, md: write(blob, [(k, np.asarray(a) + 1) for k, a in tensors], md))
    result = run("convert", src, dst, "--force")
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {os.path.abspath(dst)}: the converted file does not read back as "
                                    "written (tensor 'enc/kernel' differs); DST was not replaced")
    assert ckpt.list_variables(dst) == [("old", [1])]
    assert sorted(os.listdir(tmp_path)) == ["dst.msgpack", "src.h5"]  # no temporary left behind


def test_convert_write_errors_name_dst_not_the_temporary_file(tmp_path, monkeypatch):
    src = save(tmp_path / "src.h5", model())
    dst = str(tmp_path / "dst.msgpack")

    def refuse(blob, tensors, metadata):
        raise ckpt.UnsupportedCheckpointError(f"{blob.name}: tensor 'dec/w' is float32, which this format cannot store")

    monkeypatch.setattr(base.get_format("msgpack"), "write_blob", refuse)
    result = run("convert", src, dst)
    assert result.exit_code == 1
    assert result.stderr == f"Error: {os.path.abspath(dst)}: tensor 'dec/w' is float32, which this format cannot " \
                            "store\n"
    assert sorted(os.listdir(tmp_path)) == ["src.h5"]


def test_convert_refuses_a_damaged_source(tmp_path):
    src = save(tmp_path / "src.msgpack", model())
    damage(src)
    result = run("convert", src, tmp_path / "out.h5")
    assert result.exit_code == 1 and "'dec/w' fails its checksum" in result.stderr
    assert not (tmp_path / "out.h5").exists()


# -- verify ----------------------------------------------------------------------------------

def test_verify_a_sound_file(tmp_path, ext):
    path = save(tmp_path / f"m{ext}", dict(every_dtype_tensors()))
    result = run("verify", path)
    assert result.exit_code == 0
    assert result.stdout == f"{path}: OK ({len(every_dtype_tensors())} tensors; the structure and every " \
                            "checksum match)\n"


def test_verify_names_each_damaged_tensor(tmp_path, ext):
    path = save(tmp_path / f"m{ext}", model())
    damage(path)
    result = run("verify", path)
    assert result.exit_code == 1
    assert result.stdout.startswith(f"{path}: tensor 'dec/w' fails its checksum")
    assert result.stderr == f"Error: {path}: 1 problem found\n"


def test_verify_a_damaged_index(tmp_path):
    path = save(tmp_path / "m.msgpack", model())
    with open(path, "r+b") as f:
        f.seek(-40, os.SEEK_END)
        f.write(b"\x00\x01")
    result = run("verify", path)
    assert result.exit_code == 1 and result.stderr.startswith(f"Error: {path}: ") and result.stdout == ""


def test_verify_says_when_a_file_has_no_checksums(tmp_path):
    path = tmp_path / "keras.h5"
    with h5py.File(path, "w") as f:
        f["dense/kernel"] = np.ones((2, 2), np.float32)
    result = run("verify", path)
    assert result.exit_code == 0
    assert result.stdout == f"{path}: 1 tensor read without error; the file has no checksums (not written by " \
                            "ckpt), so their values cannot be vouched for\n"


def test_verify_missing(tmp_path):
    result = run("verify", tmp_path / "m.h5")
    assert result.exit_code == 1 and result.stderr == f"Error: {tmp_path / 'm.h5'}: no such checkpoint file\n"


# -- ls --------------------------------------------------------------------------------------

def test_ls_lists_the_state_file_and_unknown_files(tmp_path):
    for name in ("model-1.h5", "model-2.msgpack", "model-3.h5", "stray.msgpack"):
        save(tmp_path / name, {"v": np.zeros(10)})
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / ".model-4.h5.ckpt-tmp-0123456789ab").write_bytes(b"half a save")
    os.utime(tmp_path / "stray.msgpack", (1735689600, 1735689600))
    write_state(str(tmp_path), CheckpointState(
        checkpoints=[CheckpointEntry("model-2.msgpack", 1735689700.0, 2), CheckpointEntry("model-3.h5", 1735689800.0, 3),
                     CheckpointEntry("model-9.h5", 1735689900.0, 9)],
        preserved=[CheckpointEntry("model-1.h5", 1735689650.0, None)]))
    size = {n: shown_size(tmp_path / n) for n in ("model-1.h5", "model-2.msgpack", "model-3.h5", "stray.msgpack")}
    result = run("ls", tmp_path)
    assert result.exit_code == 0, result.stderr
    rows = [line.split("  ") for line in result.stdout.splitlines()]
    rows = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    assert rows == [
        ["path", "step", "saved (UTC)", "size"],
        ["model-1.h5", "-", "2025-01-01 00:00:50", size["model-1.h5"], "preserved"],
        ["model-2.msgpack", "2", "2025-01-01 00:01:40", size["model-2.msgpack"]],
        ["model-3.h5", "3", "2025-01-01 00:03:20", size["model-3.h5"], "latest"],
        ["model-9.h5", "9", "2025-01-01 00:05:00", "-", "missing"],
        ["stray.msgpack", "-", "2025-01-01 00:00:00", size["stray.msgpack"], "not in the 'checkpoint' state file"],
    ]


def shown_size(path) -> str:
    return human_size(os.path.getsize(path))


def test_ls_of_a_saver_directory(tmp_path):
    saver = ckpt.Saver({"v": ckpt.Variable(np.zeros(3, np.float32))}, max_to_keep=2)
    for step in (10, 20, 30):
        saver.save(tmp_path / "model.msgpack", global_step=step)
    lines = run("ls", tmp_path).stdout.splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [["model-20.msgpack", "20"], ["model-30.msgpack", "30"]]
    assert lines[-1].endswith("  latest") and not lines[1].endswith("latest")


def test_ls_of_a_tensorflow_directory_counts_a_prefix_files(tmp_path):
    fixture = os.path.join(TESTS, "fixtures", "foreign", "tf1_saver")
    if not os.path.isdir(fixture):
        pytest.skip("the TensorFlow fixture is not in this checkout")
    shutil.copytree(fixture, tmp_path / "tf")
    size = sum(os.path.getsize(tmp_path / "tf" / n) for n in os.listdir(tmp_path / "tf") if n != "checkpoint")
    result = run("ls", tmp_path / "tf")
    assert result.exit_code == 0, result.stderr
    assert re.split(r"\s{2,}", result.stdout.splitlines()[1].strip()) == \
        ["model.ckpt-7", "-", "-", human_size(size), "latest"]
    assert len(result.stdout.splitlines()) == 2  # its .index and .data files are part of it, not unknown files


def test_ls_without_a_state_file_shows_the_files(tmp_path):
    save(tmp_path / "a.h5", {"v": np.zeros(1)})
    result = run("ls", tmp_path)
    assert result.exit_code == 0
    assert result.stdout.splitlines()[1].startswith("a.h5") and "not in the 'checkpoint' state file" in result.stdout


def test_ls_errors(tmp_path):
    result = run("ls", tmp_path / "nothing")
    assert result.exit_code == 1 and result.stderr == f"Error: {tmp_path / 'nothing'}: no such directory\n"
    file = save(tmp_path / "a.h5", {"v": np.zeros(1)})
    result = run("ls", file)
    assert result.exit_code == 1 and result.stderr == f"Error: {file}: not a directory\n"
    (tmp_path / "empty").mkdir()
    result = run("ls", tmp_path / "empty")
    assert result.exit_code == 1 and result.stderr.startswith(f"Error: {tmp_path / 'empty'}: no checkpoints")
    (tmp_path / "empty" / "checkpoint").write_text("{not json")
    result = run("ls", tmp_path / "empty")
    assert result.exit_code == 1 and "the state file is not valid JSON" in result.stderr


# -- progress --------------------------------------------------------------------------------

class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal_and_for_large_data():
    assert progress.shows_progress(progress.MIN_BYTES, FakeTerminal())
    assert not progress.shows_progress(progress.MIN_BYTES - 1, FakeTerminal())
    assert not progress.shows_progress(1 << 40, io.StringIO())
    assert progress.shows_progress(10, FakeTerminal(), min_bytes=10)
    assert not progress.shows_progress(10, io.StringIO(), min_bytes=0)


def test_commands_stay_quiet_when_piped(tmp_path, monkeypatch):
    import functools
    import importlib

    for command in ("inspect_cmd", "diff_cmd", "convert_cmd", "verify_cmd"):  # any data would earn a bar
        module = importlib.import_module(f"ckpt.cli.{command}")
        for name in ("byte_bar", "shows_progress"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, functools.partial(getattr(progress, name), min_bytes=0))
    src = save(tmp_path / "m.h5", model())
    for args in (["verify", src], ["convert", src, tmp_path / "o.msgpack"], ["inspect", src, "--stats"],
                 ["diff", src, tmp_path / "o.msgpack"]):
        result = run(*args)
        assert result.exit_code == 0 and result.stderr == ""


@pytest.mark.parametrize("command", ["inspect_cmd", "diff_cmd", "convert_cmd"])
def test_output_is_the_same_with_a_progress_bar(tmp_path, monkeypatch, command):
    import importlib

    src = save(tmp_path / "m.h5", model())
    args = {"inspect_cmd": ["inspect", src, "--stats"], "diff_cmd": ["diff", src, src],
            "convert_cmd": ["convert", src, tmp_path / "o.msgpack"]}[command]
    quiet = run(*args)
    if command == "convert_cmd":
        os.remove(tmp_path / "o.msgpack")
    module = importlib.import_module(f"ckpt.cli.{command}")
    monkeypatch.setattr(module if hasattr(module, "shows_progress") else progress, "shows_progress",
                        lambda nbytes, stream=None, min_bytes=0: True)
    barred = run(*args)
    assert barred.stdout == quiet.stdout and barred.exit_code == quiet.exit_code == 0
    assert barred.stderr != ""  # the bar's label (hidden off a terminal, as click does)


def test_verify_reports_progress_through_the_reader(tmp_path, monkeypatch):
    src = save(tmp_path / "m.h5", model())
    seen = []
    with ckpt.load_checkpoint(src) as reader:
        assert reader.verify(seen.append) == []
        assert sum(seen) == sum(info.nbytes for info in reader.tensors.values()) and len(seen) == len(reader.tensors)
    terminal = FakeTerminal()
    with progress.byte_bar(sum(seen), "verifying", terminal, min_bytes=0) as update:
        for n in seen:
            update(n)
    assert "verifying" in terminal.getvalue() and "100%" in terminal.getvalue()
    with progress.byte_bar(sum(seen), "verifying", io.StringIO()) as update:
        assert update is None  # not a terminal: no bar


def test_a_bar_advances_within_one_large_tensor_by_the_bytes_read(monkeypatch):
    counter = [10_000]
    monkeypatch.setattr(progress, "read_bytes", lambda: counter[0])
    terminal = FakeTerminal()
    with progress.byte_bar(1 << 30, "verifying", terminal) as update:  # one 1 GiB tensor
        counter[0] += 1 << 29  # half of it read; the tensor is not finished
        update.__self__.refresh()
        assert "50%" in terminal.getvalue() and "100%" not in terminal.getvalue()
        counter[0] += 1 << 30  # more read than the bar's total (say, an index): capped
        update.__self__.refresh()
        update(1 << 30)
    assert "100%" in terminal.getvalue()
    with progress.byte_bar(1 << 30, "checking", terminal, io_factor=2) as update:
        counter[0] += 1 << 29  # checking reads two files: a quarter of the way
        update.__self__.refresh()
        assert "25%" in terminal.getvalue().split("checking")[-1]


def test_bytes_read_are_counted_where_the_system_says():
    before = progress.read_bytes()
    if before is None:
        pytest.skip("no /proc/self/io here")
    with open(__file__, "rb") as f:
        size = len(f.read())
    assert progress.read_bytes() - before >= size


# -- the installed console script -------------------------------------------------------------

def console_script() -> str:
    path = os.path.join(os.path.dirname(sys.executable), "ckpt")
    if not os.path.exists(path):
        pytest.skip("the ckpt console script is not installed next to this Python")
    return path


def test_console_script_runs_and_reports_errors_in_one_line(tmp_path):
    script = console_script()
    mlp = os.path.join(SAMPLES, "mlp.h5")
    ok = subprocess.run([script, "inspect", mlp], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.endswith("# Total number of params: 50890\n") and ok.stderr == ""
    missing = subprocess.run([script, "verify", str(tmp_path / "x.h5")], capture_output=True, text=True, timeout=60)
    assert (missing.returncode, missing.stderr) == (1, f"Error: {tmp_path / 'x.h5'}: no such checkpoint file\n")
    usage = subprocess.run([script, "diff", mlp], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and usage.stderr.startswith("Error: Missing argument 'B'")
    assert usage.stderr.count("\n") == 1
    differ = subprocess.run([script, "diff", mlp, os.path.join(SAMPLES, "steps")], capture_output=True, text=True,
                            timeout=60)
    assert differ.returncode == 1 and differ.stdout.endswith("# different: 4 only in A, 3 only in B, "
                                                             "7 metadata keys differ\n")


def test_console_script_stops_quietly_when_the_pipe_closes():
    script = console_script()
    proc = subprocess.Popen([script, "inspect", os.path.join(SAMPLES, "mlp.h5"), "--all-tensors",
                             "--printoptions", "threshold=1000000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(10) == b"tensor: hi"
    proc.stdout.close()  # like "| head -c 10"
    assert proc.wait(timeout=60) == 0  # not 1, which means a checkpoint problem
    assert proc.stderr.read() == b""
    proc.stderr.close()


def test_convert_reads_each_tensor_only_when_the_writer_writes_it(tmp_path, monkeypatch):
    """Bounded memory: SRC's tensors reach the writer as lazy sources, read one at a time."""
    src = save(tmp_path / "src.h5", {f"t{i}": np.full(1000, i, np.float32) for i in range(4)})
    reads = []
    get_tensor, read_into = ckpt.CheckpointReader.get_tensor, ckpt.CheckpointReader.read_into
    monkeypatch.setattr(ckpt.CheckpointReader, "get_tensor", lambda self, key: reads.append(key) or get_tensor(self, key))
    monkeypatch.setattr(ckpt.CheckpointReader, "read_into",
                        lambda self, key, out: reads.append(key) or read_into(self, key, out))
    fmt = base.get_format("msgpack")
    write = fmt.write_blob

    def spy(blob, tensors, metadata):
        assert reads == [] and not any(isinstance(source, np.ndarray) for _, source in tensors)
        write(blob, tensors, metadata)
        assert reads == ["t0", "t1", "t2", "t3"]

    monkeypatch.setattr(fmt, "write_blob", spy)
    result = run("convert", src, tmp_path / "out.msgpack")
    assert result.exit_code == 0
    assert ckpt.load_variable(tmp_path / "out.msgpack", "t3").tolist() == [3.0] * 1000


# --- what a new user tripped over -------------------------------------------------------------
def test_convert_refuses_an_existing_dst_without_force(tmp_path):
    src = save(tmp_path / "src.h5", model())
    dst = save(tmp_path / "dst.msgpack", {"old": np.ones(1)})
    before = pathlib.Path(dst).read_bytes()
    result = run("convert", src, dst)
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()  # click quotes 'DST' or not, by version
    assert line.startswith("Error: Invalid value for") and line.endswith(
        f"DST: {dst} exists; pass --force to replace it (see 'ckpt convert --help')"), line
    assert pathlib.Path(dst).read_bytes() == before
    result = run("convert", src, dst, "--force")
    assert result.exit_code == 0
    with ckpt.load_checkpoint(dst) as reader:
        assert sorted(reader) == sorted(model())


def test_diff_compares_metadata(tmp_path):
    a = save(tmp_path / "a.h5", model(), {"step": 1, "lr": 0.1, "tags": ["x"]})
    b = save(tmp_path / "b.msgpack", model(), {"step": 2, "tags": ["x"], "note": "é"})
    result = run("diff", a, b)
    assert result.exit_code == 1
    assert result.stdout.splitlines()[2:] == [
        '- metadata "lr": 0.1',
        '+ metadata "note": "\\u00e9"',
        '! metadata "step": 1 -> 2',
        "# different: 3 identical, 3 metadata keys differ",
    ]
    same = save(tmp_path / "c.msgpack", model(), {"step": 1, "lr": 0.1, "tags": ["x"]})
    result = run("diff", a, same)
    assert result.exit_code == 0 and result.stdout.endswith("# same: 3 identical\n")


def test_summaries_use_singular_and_plural(tmp_path):
    src = save(tmp_path / "one.h5", {"w": np.array([1.0, 2.0])})
    assert "# Excluding 1 tensor (2 params) that matches ^w when counting." in run("inspect", src, "--exclude", "^w").stdout
    out = run("convert", src, tmp_path / "one.msgpack").stdout
    assert ": 1 tensor from " in out and "tensors" not in out
    assert "OK (1 tensor;" in run("verify", src).stdout
    other = save(tmp_path / "other.h5", {"w": np.array([1.0, 2.5])})
    lines = run("diff", src, other).stdout.splitlines()
    assert lines[2].startswith("! w (float64) [2]: 1 of 2 values differs")
    assert lines[3] == "# different: 1 differs"


def json_error(result) -> dict:
    (line,) = result.stderr.splitlines()
    return json.loads(line)


def test_verify_json(tmp_path):
    path = save(tmp_path / "m.msgpack", model())
    result = run("verify", path, "--json")
    assert result.exit_code == 0 and result.stderr == ""
    assert json.loads(result.stdout) == {"path": path, "format": "msgpack", "checksummed": True, "tensors": 3,
                                         "problems": [], "ok": True}
    damage(path)
    result = run("verify", path, "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["ok"] is False and len(doc["problems"]) == 1
    assert "'dec/w'" in doc["problems"][0]
    assert json_error(result) == {"error": f"{path}: 1 problem found", "file": path, "key": None}


def test_diff_json(tmp_path):
    a = save(tmp_path / "a.h5", model(gone=np.ones(2)), {"step": 1})
    b = save(tmp_path / "b.h5", {**model(), "enc/kernel": np.zeros((2, 3), np.float32)}, {"step": 2})
    result = run("diff", a, b, "--json")
    assert result.exit_code == 1 and result.stderr == ""
    doc = json.loads(result.stdout)
    assert (doc["a"], doc["b"], doc["same"]) == (a, b, False)
    assert doc["counts"] == {"only in A": 1, "only in B": 0, "changed dtype or shape": 0, "differ": 1,
                             "within tolerance": 0, "identical": 2, "metadata": 1}
    by_key = {c["key"]: c for c in doc["changes"]}
    assert by_key["gone"] == {"key": "gone", "change": "only in A", "a": {"dtype": "float64", "shape": [2]}}
    assert by_key["enc/kernel"]["change"] == "differ"
    assert by_key["enc/kernel"]["values"] == {"count": 6, "unequal": 5, "outside": 5, "max_abs": 5.0,
                                              "max_rel": "Infinity", "rel_l2": 1.0}
    assert by_key["step"] == {"key": "step", "change": "metadata", "a": 1, "b": 2}
    assert json.loads(run("diff", a, a, "--json").stdout)["same"] is True


def test_ls_json(tmp_path):
    saver = ckpt.Saver({"v": ckpt.Variable(1.0)})
    for step in (1, 2):
        saver.save(str(tmp_path / "m.h5"), global_step=step)
    save(tmp_path / "stray.msgpack", {"v": np.ones(1)})
    result = run("ls", tmp_path, "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["directory"] == str(tmp_path)
    rows = doc["checkpoints"]
    assert [(r["path"], r["step"], r["latest"]) for r in rows] == [("m-1.h5", 1, False), ("m-2.h5", 2, True),
                                                                  ("stray.msgpack", None, False)]
    assert rows[0]["size"] == os.path.getsize(tmp_path / "m-1.h5") and isinstance(rows[0]["time"], float)
    assert rows[2]["note"] == "not in the 'checkpoint' state file"


@pytest.mark.parametrize("command", ["inspect", "verify", "diff", "ls"])
def test_errors_under_json_are_json_on_stderr_with_the_same_exit_codes(tmp_path, command):
    missing = str(tmp_path / "none.h5")
    args = {"diff": [missing, missing]}.get(command, [missing])
    text, as_json = run(command, *args), run(command, *args, "--json")
    assert as_json.exit_code == text.exit_code != 0 and as_json.stdout == ""
    error = json_error(as_json)
    assert error["file"] == missing and text.stderr == f"Error: {error['error']}\n"
    usage = run(command, "--json")  # a usage error: exit 2, JSON too
    assert usage.exit_code == 2 and json_error(usage)["error"].startswith("Missing argument")


def test_json_errors_name_the_key(tmp_path):
    path = save(tmp_path / "m.h5", model())
    result = run("inspect", path, "--tensor", "enc/kernal", "--json")
    assert result.exit_code == 1
    assert json_error(result) == {
        "error": f"Tensor enc/kernal not found in checkpoint {path}; closest keys: enc/kernel, enc/bias",
        "file": path, "key": "enc/kernal"}


def test_json_errors_take_file_and_key_from_the_error_not_its_message(tmp_path):
    """A path with ": " in it, two paths on the command line and a damaged tensor: the error carries
    the file and key (CheckpointError.path/.key); nothing is parsed out of the message."""
    folder = tmp_path / "run: 2"
    folder.mkdir()
    a = save(tmp_path / "a.msgpack", model())
    b = save(folder / "b.msgpack", model())
    damage(b)
    result = run("diff", a, b, "--json")
    assert result.exit_code == 2
    error = json_error(result)
    assert (error["file"], error["key"]) == (b, "dec/w") and "fails its checksum" in error["error"]


# -- issue 26: what a newcomer's shell sees ---------------------------------------------------

def test_inspect_of_a_directory_names_the_checkpoint_it_shows(tmp_path):
    ckpt.Saver({"w": ckpt.Variable(np.arange(3.0))}).save(str(tmp_path / "run" / "m.h5"), global_step=4)
    shown = str(tmp_path / "run" / "m-4.h5")
    result = run("inspect", tmp_path / "run")
    assert result.exit_code == 0
    assert result.stdout.splitlines()[:2] == [f"# checkpoint: {shown}", "tensor: w (float64) [3]"]
    names = run("inspect", tmp_path / "run", "--names-only")  # the keys stay a clean list
    assert (names.stdout, names.stderr) == ("w\n", f"# checkpoint: {shown}\n")
    assert "# checkpoint" not in run("inspect", shown).stdout  # a file names itself


def test_not_a_checkpoint_lists_formats_without_empty_extensions(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello")
    result = run("inspect", junk)
    assert result.exit_code == 1
    assert "()" not in result.stderr and "ckpt-sharded," in result.stderr and "hdf5 (.h5/.hdf5)" in result.stderr


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_stats_of_zeros_show_bins_of_one(tmp_path, dtype):
    path = save(tmp_path / "z.h5", {"z": np.zeros((4, 3), dtype)})
    result = run("inspect", path, "--stats")
    assert "  histogram 0 |█               | 16" in result.stdout.splitlines(), result.stdout
    doc = json.loads(run("inspect", path, "--stats", "--json").stdout)
    assert doc["tensors"][0]["stats"]["histogram_edges"] == list(range(17))


def test_ctrl_c_exits_130_not_the_checkpoint_problem_code(tmp_path, monkeypatch):
    path = save(tmp_path / "m.h5", model())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "inspect_lines", interrupted)
    result = run("inspect", path)
    assert result.exit_code == 130
    assert result.stderr.strip() == "Aborted!"


def test_a_closed_output_pipe_ends_quietly_with_0(tmp_path):
    """``ckpt inspect ... | head``: the reader goes away; no error, no traceback, exit 0."""
    path = save(tmp_path / "m.h5", {f"t{i}": np.arange(2000.0) for i in range(100)})  # MBs of values
    ckpt_command = console_script()
    for early in (True, False):  # the pipe closed before the first write, or after the first line
        proc = subprocess.Popen([ckpt_command, "inspect", path, "--all-tensors", "--printoptions",
                                 "threshold=100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if not early:
            assert proc.stdout.readline().startswith(b"tensor: ")
        proc.stdout.close()
        _, err = proc.communicate(timeout=60)
        assert (proc.returncode, err) == (0, b"")


def test_json_not_found_error_of_a_directory_names_the_file_and_keeps_the_closest_keys(tmp_path):
    """`ckpt inspect DIR --tensor K --json` on a missing key: "file" is the checkpoint the directory
    resolved to (not the directory) and the message keeps the closest keys."""
    saver = ckpt.Saver({"softmax/kernel": ckpt.Variable(np.zeros((2, 2))), "softmax/bias": ckpt.Variable([0.0])})
    path = saver.save(str(tmp_path / "run" / "model.msgpack"), global_step=5)
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "run"), "--tensor", "softmax/kernl", "--json"])
    assert result.exit_code == 1
    error = json.loads(result.output.strip().splitlines()[-1])
    assert error["file"] == path and error["key"] == "softmax/kernl"
    assert "closest keys: softmax/kernel" in error["error"]
