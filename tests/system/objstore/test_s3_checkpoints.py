"""Checkpoints at s3:// URLs, end to end against moto's S3 server on 127.0.0.1: every dtype,
retention, latest, racing savers, a SIGKILL mid-save, the create-only commit, store faults,
the CLI, and the requests and bytes of a one-tensor read."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_bit_exact, every_dtype_tensors, OUTSIDE_CHECKOUT

import ckpt
from ckpt.storage import remote as _remote

pytest.importorskip("s3fs")


def _keys(bucket_url: str, prefix: str = "") -> list[str]:
    import boto3

    resp = boto3.client("s3").list_objects_v2(Bucket=bucket_url[5:], Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


@pytest.mark.parametrize("fmt", ["msgpack", "hdf5"])
def test_every_dtype_round_trips_through_s3(fmt, s3_bucket):
    tensors = every_dtype_tensors()
    variables = {key: ckpt.Variable(value) for key, value in tensors}
    saver = ckpt.Saver(variables, format=fmt)
    url = saver.save(f"{s3_bucket}/run/model", global_step=3, metadata={"lr": 0.5})
    assert url == f"{s3_bucket}/run/model-3.{'h5' if fmt == 'hdf5' else 'msgpack'}"
    fresh = {key: ckpt.Variable(np.zeros_like(value) if value.dtype.kind != "O" else np.full(value.shape, b"z", object))
             for key, value in tensors}
    result = ckpt.Saver(fresh, format=fmt).restore(f"{s3_bucket}/run")
    assert result.path == url and sorted(result.restored) == sorted(k for k, _ in tensors)
    for key, value in tensors:
        assert_bit_exact(value, np.asarray(fresh[key].numpy(), dtype=value.dtype))
    with ckpt.load_checkpoint(url) as reader:
        assert reader.metadata == {"lr": 0.5} and reader.verify() == []
        for key, value in tensors:
            assert_bit_exact(value, reader.get_tensor(key))


def test_retention_latest_and_state_file(s3_bucket):
    v = ckpt.Variable(np.arange(4.0), name="v")
    saver = ckpt.Saver([v], max_to_keep=2, format="msgpack")
    for step in range(4):
        v.assign(np.full(4, float(step)))
        saver.save(f"{s3_bucket}/run/model", global_step=step)
    latest = f"{s3_bucket}/run/model-3.msgpack"
    assert ckpt.latest_checkpoint(f"{s3_bucket}/run") == latest
    assert saver.last_checkpoints == [f"{s3_bucket}/run/model-2.msgpack", latest]
    keys = _keys(s3_bucket, "run/")
    # the dropped checkpoints are gone: commit records and data objects
    assert [k for k in keys if not k.startswith("run/.ckpt-data/")] == \
        ["run/checkpoint", "run/model-2.msgpack", "run/model-3.msgpack"]
    assert sorted(k.split("/")[2] for k in keys if k.startswith("run/.ckpt-data/")) == \
        ["model-2.msgpack", "model-3.msgpack"]
    assert ckpt.load_variable(f"{s3_bucket}/run", "v").tolist() == [3.0] * 4
    assert ckpt.latest_checkpoint(f"{s3_bucket}/empty") is None


def test_racing_savers_lose_no_state_entry(s3_bucket):
    errors = []

    def run(writer: int) -> None:
        try:
            saver = ckpt.Saver({"w": ckpt.Variable(np.full(3, writer, np.int32))}, max_to_keep=None,
                               format="msgpack")
            for step in range(3):
                saver.save(f"{s3_bucket}/run/w{writer}", global_step=step)
        except Exception as exc:  # reported below: a thread's exception would be lost
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    state = _remote.RemoteDirectory(f"{s3_bucket}/run").read_state()
    assert sorted(e.path for e in state.checkpoints) == sorted(f"w{w}-{s}.msgpack" for w in range(3) for s in range(3))


def test_the_commit_refuses_a_second_writer(s3_bucket):
    v = ckpt.Variable([1.0, 2.0], name="v")
    url = ckpt.Saver([v], format="msgpack").save(f"{s3_bucket}/run/model.msgpack")
    v.assign([5.0, 6.0])
    with pytest.raises(ckpt.CheckpointWriteError, match=f"{url}: .*create-only.*nothing was committed"):
        ckpt.Saver([v]).save(url)
    assert ckpt.load_variable(url, "v").tolist() == [1.0, 2.0]
    assert len(_keys(s3_bucket, "run/.ckpt-data/")) == 1  # the refused writer's data is gone


_CHILD = """
import sys, numpy as np, ckpt
url, step = sys.argv[1], int(sys.argv[2])  # each child its own steps: names are written once
variables = {f"t{i}": ckpt.Variable(np.zeros(50_000, np.float32)) for i in range(4)}
saver = ckpt.Saver(variables, max_to_keep=2, format="msgpack")
while True:
    for var in variables.values():
        var.assign(np.full(50_000, step, np.float32))
    saver.save(url + "/model", global_step=step)
    print(step, flush=True)
    step += 1
"""


def test_sigkill_mid_save_leaves_the_latest_restorable_and_its_orphans_cleanable(s3_bucket):
    run = f"{s3_bucket}/run"
    rng = random.Random(0)
    last = -1
    for kill in range(3):
        with subprocess.Popen([sys.executable, "-c", _CHILD, run, str(1000 * kill)], stdout=subprocess.PIPE,
                              text=True, cwd=OUTSIDE_CHECKOUT) as child:
            assert child.stdout is not None
            assert child.stdout.readline()  # one save done: the next ones are under way
            time.sleep(rng.uniform(0.0, 0.3))
            child.kill()
            assert child.wait() == -9  # killed, not failed on its own
        latest = ckpt.latest_checkpoint(run)
        assert latest is not None
        with ckpt.load_checkpoint(latest) as reader:
            assert reader.verify() == []
            steps = {float(reader.get_tensor(f"t{i}")[0]) for i in range(4)}
        assert len(steps) == 1  # whole: every tensor from one save
        step = steps.pop()
        assert step >= last  # never older than before
        last = step
    # uncommitted data objects (if the kills left any) go past the grace time
    ckpt.Saver({"x": ckpt.Variable(1.0)}, max_to_keep=None).save(f"{run}/other.msgpack")
    _remote.RemoteDirectory(run).clean_orphans(grace_s=0.0)
    committed = {_remote.RemoteDirectory(run).locate(name)[0] for name in
                 (k.split("/", 1)[1] for k in _keys(s3_bucket, "run/")
                  if not k.startswith("run/.ckpt-data/") and k != "run/checkpoint")}
    data = {f"{s3_bucket}/{k}" for k in _keys(s3_bucket, "run/.ckpt-data/")}
    assert data == committed


# -- faults ----------------------------------------------------------------------------------

def test_missing_bucket_and_object(s3_bucket):
    v = ckpt.Variable([1.0], name="v")
    with pytest.raises(ckpt.CheckpointNotFoundError,
                       match="s3://no-such-bucket-ckpt/m.msgpack: .*bucket does not exist"):
        ckpt.Saver([v]).save("s3://no-such-bucket-ckpt/m.msgpack")
    with pytest.raises(ckpt.CheckpointNotFoundError, match="s3://no-such-bucket-ckpt/m.msgpack"):
        ckpt.load_checkpoint("s3://no-such-bucket-ckpt/m.msgpack")
    with pytest.raises(ckpt.CheckpointNotFoundError, match=f"{s3_bucket}/nothing.msgpack: no such checkpoint"):
        ckpt.load_checkpoint(f"{s3_bucket}/nothing.msgpack")
    with pytest.raises(ckpt.CheckpointNotFoundError, match=f"{s3_bucket}/run: no checkpoint in this directory"):
        ckpt.Saver([v]).restore(f"{s3_bucket}/run")
    assert _keys(s3_bucket) == []


def test_unreachable_store_names_the_url_and_commits_nothing():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
    v = ckpt.Variable([1.0], name="v")
    with pytest.raises(ckpt.CheckpointWriteError, match="s3://bkt/run/m.msgpack: .*cannot be reached"):
        ckpt.Saver([v], storage_options=options).save("s3://bkt/run/m.msgpack")
    with pytest.raises(ckpt.StorageError, match="s3://bkt/run/m.msgpack: .*cannot be reached"):
        ckpt.load_checkpoint("s3://bkt/run/m.msgpack", storage_options=options)
    with pytest.raises(ckpt.StorageError, match="s3://bkt/run/checkpoint: .*cannot be reached"):
        ckpt.latest_checkpoint("s3://bkt/run", storage_options=options)


@pytest.fixture
def proxy(s3_server):
    """A FaultProxy in front of the test S3 server (closed after the test)."""
    from faultproxy import FaultProxy

    proxy = FaultProxy(int(s3_server.endpoint.rpartition(":")[2]))
    yield proxy
    proxy.close()


def _through(proxy, **timeouts) -> dict:
    """storage_options that reach the store through ``proxy``, failing fast (one attempt)."""
    return {"endpoint_url": proxy.endpoint, "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2,
                                                              "read_timeout": 2}, **timeouts}


@pytest.mark.parametrize("fmt", ["msgpack", "hdf5"])
def test_the_endpoint_going_away_mid_restore_is_a_storage_fault_not_damage(fmt, s3_bucket, proxy):
    v = ckpt.Variable(np.arange(1 << 20, dtype=np.float32), name="w")  # 4 MiB
    url = ckpt.Saver([v], format=fmt).save(f"{s3_bucket}/run/m")
    fresh = ckpt.Variable(np.zeros(1 << 20, np.float32), name="w")
    proxy.arm(1 << 20, "vanish")  # the commit record (~90 KB) goes through, the tensor does not
    with pytest.raises(ckpt.StorageError, match=f"{s3_bucket}/run/.*: reading tensor 'w'") as caught:
        ckpt.Saver([fresh], storage_options=_through(proxy)).restore(url)
    assert not isinstance(caught.value, ckpt.CorruptCheckpointError)


def _ends(call):
    """What ``call()`` raised, run in a thread given 60 s to finish (a hang fails the test
    instead of stalling the suite; the deadlines under test are a second or two)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            out.append(None)
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert out, "the call did not end: no deadline"
    return out[0]


def test_an_endpoint_that_accepts_and_never_answers_ends_in_a_storage_error_naming_the_url():
    from faultproxy import silent

    sock, accepted = silent()
    options = {"endpoint_url": f"http://127.0.0.1:{sock.getsockname()[1]}", "key": "k", "secret": "s",
               "ckpt_timeout": 0.5}  # botocore's own timeouts (5 s connect, 15 s read) left as they are
    v = ckpt.Variable([1.0], name="v")
    try:
        for call, url in [(lambda: ckpt.latest_checkpoint("s3://bkt/run", storage_options=options),
                           "s3://bkt/run/checkpoint"),
                          (lambda: ckpt.load_checkpoint("s3://bkt/run/m.msgpack", storage_options=options),
                           "s3://bkt/run/m.msgpack"),
                          (lambda: ckpt.Saver([v], storage_options=options).restore("s3://bkt/run"),
                           "s3://bkt/run/checkpoint")]:
            err = _ends(call)
            assert isinstance(err, ckpt.StorageError) and str(err).startswith(f"{url}: "), err
            assert "no answer within" in str(err) and "ckpt_timeout=0.5" in str(err)
        err = _ends(lambda: ckpt.Saver([v], storage_options=options).save("s3://bkt/run/m.msgpack"))
        assert isinstance(err, ckpt.CheckpointWriteError) and isinstance(err.__cause__, ckpt.StorageError), err
        assert "s3://bkt/run/m.msgpack: cannot save: s3://bkt/run" in str(err) and "no answer within" in str(err)
        assert accepted  # it was reached, and said nothing
    finally:
        sock.close()
        for conn in accepted:
            conn.close()


def test_a_transfer_that_stalls_midway_ends_in_a_storage_error_naming_the_url(s3_bucket, proxy):
    v = ckpt.Variable(np.arange(1 << 20, dtype=np.float32), name="w")  # 4 MiB
    url = ckpt.Saver([v], format="msgpack").save(f"{s3_bucket}/run/m")
    # 3 s, not 1: moto on a loaded 2-core machine can take over a second to answer the open itself
    options = {"endpoint_url": proxy.endpoint, "ckpt_timeout": 3, "ckpt_rate": 1 << 40}
    reader = ckpt.load_checkpoint(url, storage_options=options)
    proxy.arm(1 << 20, "stall")  # the tensor's GET sends a quarter of it, then nothing
    err = _ends(lambda: reader.get_tensor("w"))
    assert isinstance(err, ckpt.StorageError) and f"{s3_bucket}/run/.ckpt-data/m.msgpack/" in str(err), err
    assert "reading tensor 'w'" in str(err) and "no answer within 3 s" in str(err)
    err = _ends(lambda: ckpt.Saver([v], storage_options=options).restore(f"{s3_bucket}/run"))
    assert isinstance(err, ckpt.StorageError) and f"{s3_bucket}/run/checkpoint: " in str(err), err


def test_a_zero_byte_state_file_reads_as_empty_not_as_a_store_fault(s3_bucket):
    """S3 answers 416 to any range of an empty object: that is b"", whose parse is damage."""
    import boto3

    boto3.client("s3").put_object(Bucket=s3_bucket[5:], Key="run/checkpoint", Body=b"")
    store = _remote.RemoteDirectory(f"{s3_bucket}/run").store
    url = f"{s3_bucket}/run/checkpoint"
    assert store.read_small(url, 1 << 20, "the state file") == b""
    data, version = store.get_versioned(url)
    assert data == b"" and version
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"{url}: the state file is not valid JSON"):
        _remote.RemoteDirectory(f"{s3_bucket}/run").read_state()
    assert store.put_if(url, b"{}", version)  # a save can replace it (compare-and-swap on its ETag)


def test_a_damaged_commit_record_is_a_corrupt_checkpoint(s3_bucket):
    import boto3

    boto3.client("s3").put_object(Bucket=s3_bucket[5:], Key="m.msgpack",
                                  Body=b'{"format": "ckpt-commit", "version": 1, "data": "../../etc", "size": 3}')
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"{s3_bucket}/m.msgpack: malformed commit record"):
        ckpt.load_checkpoint(f"{s3_bucket}/m.msgpack")


def test_a_commit_record_with_a_damaged_copy_is_a_corrupt_checkpoint(s3_bucket):
    import base64
    import json

    v = ckpt.Variable(np.arange(10, dtype=np.float32), name="w")
    url = ckpt.Saver([v], format="msgpack").save(f"{s3_bucket}/run/m.msgpack")
    store = _remote.RemoteDirectory(f"{s3_bucket}/run").store
    doc = json.loads(store.read_small(url, 1 << 20, "x"))
    head = bytearray(base64.b64decode(doc["head"]))
    head[len(head) // 2] ^= 1  # a small file: all of it is in the head's copy
    doc["head"] = base64.b64encode(head).decode()
    store.delete([url])
    store.put(url, json.dumps(doc).encode(), create_only=True)
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"{url}: the commit record's copy .* damaged"):
        ckpt.load_checkpoint(url)


def _record(url: str) -> dict:
    import json

    return json.loads(_remote.RemoteDirectory(url.rpartition("/")[0]).store.read_small(url, 1 << 20, "x"))


def _replace_record(url: str, doc: dict) -> None:
    import json

    store = _remote.RemoteDirectory(url.rpartition("/")[0]).store
    store.delete([url])
    store.put(url, json.dumps(doc).encode(), create_only=True)


def _two_steps(s3_bucket: str) -> tuple[list[ckpt.Variable], str, str]:
    v = [ckpt.Variable(np.zeros(4, np.float32), name="w")]
    saver = ckpt.Saver(v, format="msgpack")
    v[0].assign(np.full(4, 1.0, np.float32))
    first = saver.save(f"{s3_bucket}/run/model", global_step=1)
    v[0].assign(np.full(4, 3.0, np.float32))
    return v, first, saver.save(f"{s3_bucket}/run/model", global_step=3)


@pytest.mark.parametrize("edit", ["copied over", "data pointed elsewhere", "old record copied over"])
def test_a_commit_record_bound_to_another_checkpoint_is_refused_naming_the_one_asked(s3_bucket, edit):
    v, first, third = _two_steps(s3_bucket)
    doc = _record(third)
    assert (doc["name"], doc["step"]) == ("model-3.msgpack", 3)
    if edit == "data pointed elsewhere":
        doc["data"] = _record(first)["data"]
    else:
        doc = _record(first)
        if edit == "old record copied over":  # written before records named their checkpoint
            del doc["name"], doc["step"]
    _replace_record(third, doc)
    expected = f"{third}: the commit record is not model-3.msgpack's: it commits model-1.msgpack"
    v[0].assign(np.zeros(4, np.float32))
    with pytest.raises(ckpt.CorruptCheckpointError, match=expected):
        ckpt.latest_checkpoint(f"{s3_bucket}/run")
    with pytest.raises(ckpt.CorruptCheckpointError, match=expected):
        ckpt.load_checkpoint(third)
    with pytest.raises(ckpt.CorruptCheckpointError, match=expected):
        ckpt.Saver(v).restore(third)
    with pytest.raises(ckpt.CorruptCheckpointError, match=expected):
        ckpt.Saver(v).restore(f"{s3_bucket}/run")
    assert v[0].numpy().tolist() == [0.0] * 4  # never step 1's values


def test_a_commit_record_of_another_step_is_refused_by_latest(s3_bucket):
    _, _, third = _two_steps(s3_bucket)
    doc = _record(third)
    doc["step"] = 2
    _replace_record(third, doc)
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"{third}: the commit record commits step 2; .* step 3"):
        ckpt.latest_checkpoint(f"{s3_bucket}/run")


def test_a_commit_record_without_name_and_step_still_opens(s3_bucket):
    """Records written before they named their checkpoint: bound through their data object's name."""
    _, _, third = _two_steps(s3_bucket)
    doc = _record(third)
    del doc["name"], doc["step"]
    _replace_record(third, doc)
    assert ckpt.latest_checkpoint(f"{s3_bucket}/run") == third
    assert ckpt.load_variable(third, "w").tolist() == [3.0] * 4


@pytest.mark.parametrize("fmt", ["msgpack", "hdf5"])
def test_verify_checks_the_data_object_itself_not_only_the_commit_records_copy(fmt, s3_bucket):
    """The index and footer a plain msgpack/h5py user of the data object reads are in its last 64 KiB."""
    import boto3

    v = ckpt.Variable(np.arange(1 << 18, dtype=np.float32), name="w")  # 1 MiB
    url = ckpt.Saver([v], format=fmt).save(f"{s3_bucket}/run/m")
    assert ckpt.verify(url).ok
    data = _remote.RemoteDirectory(f"{s3_bucket}/run").locate(url.rpartition("/")[2])[0]
    client, key = boto3.client("s3"), data[len(s3_bucket) + 1:]
    body = bytearray(client.get_object(Bucket=s3_bucket[5:], Key=key)["Body"].read())
    body[-100] ^= 0x40
    client.put_object(Bucket=s3_bucket[5:], Key=key, Body=bytes(body))
    report = ckpt.verify(url)
    assert not report.ok and report.problems == [
        f"{data}: bytes {len(body) - 65536}-{len(body) - 1} (its tail) differ from the commit record's copy of them: "
        "the data object is damaged (ckpt reads the copy; a plain msgpack or h5py reader of the object reads the "
        "damage)"]


def test_a_plain_uploaded_checkpoint_reads_too(s3_bucket, tmp_path):
    import boto3

    local = ckpt.Saver({"w": ckpt.Variable(np.arange(6.0).reshape(2, 3))}).save(str(tmp_path / "m.msgpack"))
    boto3.client("s3").upload_file(local, s3_bucket[5:], "uploaded/m.msgpack")
    assert ckpt.load_variable(f"{s3_bucket}/uploaded/m.msgpack", "w").tolist() == [[0, 1, 2], [3, 4, 5]]


# -- reads fetch only what they need -----------------------------------------------------------

def test_a_one_tensor_read_fetches_the_index_and_that_tensor(s3_bucket, s3_server):
    tensors = {f"layer{i}/w": ckpt.Variable(np.full((256, 1024), i, np.float32)) for i in range(8)}  # 8 MiB
    url = ckpt.Saver(tensors, format="msgpack").save(f"{s3_bucket}/run/big.msgpack")
    s3_server.traffic.clear()
    assert ckpt.load_variable(url, "layer5/w")[0, 0] == 5
    gets = s3_server.traffic.gets()
    assert all(rng.startswith("bytes=") for _, _, rng, _ in gets)  # ranged GETs only
    commit = [g for g in gets if g[1].endswith("/big.msgpack")]
    data = [g for g in gets if "/.ckpt-data/" in g[1]]
    # the commit record (it carries the data's head and tail: header, footer, index); the tensor
    assert len(commit) == 1 and len(data) == 1 and len(gets) == 2
    record_limit = (_remote.OPEN_HEAD + _remote.OPEN_TAIL) * 4 // 3 + 1024  # base64 copies and the JSON
    assert commit[0][3] <= record_limit
    tensor_bytes = 256 * 1024 * 4
    assert data[0][3] == tensor_bytes
    s3_server.traffic.clear()
    ckpt.list_variables(url)  # the index only: the commit record
    assert [g[1] for g in s3_server.traffic.gets()] == [commit[0][1]]


@pytest.mark.parametrize("fmt", ["msgpack", "hdf5"])
def test_restoring_many_small_tensors_costs_one_get_per_cluster(fmt, s3_bucket, s3_server):
    """1,500 tensors of 2 KiB: beyond opening the checkpoint (the part of its index the commit
    record's copy lacks), a restore of all of them is one GET; one of two groups of 50 that lie
    far apart is two GETs holding little more than those tensors."""
    values = {f"t{i:04d}": ckpt.Variable(np.full(512, i, np.float32)) for i in range(1500)}
    url = ckpt.Saver(values, format=fmt).save(f"{s3_bucket}/run/small")
    s3_server.traffic.clear()
    with ckpt.load_checkpoint(url):
        opening = [g for g in s3_server.traffic.gets() if "/.ckpt-data/" in g[1]]
    for v in values.values():
        v.assign(np.zeros(512, np.float32))
    s3_server.traffic.clear()
    ckpt.Saver(values).restore(url)
    assert all(v.numpy()[0] == int(k[1:]) for k, v in values.items())
    assert [g for g in s3_server.traffic.gets() if "/.ckpt-data/" in g[1]][:len(opening)] == opening
    assert sum("/.ckpt-data/" in g[1] for g in s3_server.traffic.gets()) == len(opening) + 1
    wanted = {k: v for k, v in values.items() if int(k[1:]) < 50 or 1000 <= int(k[1:]) < 1050}
    for v in wanted.values():
        v.assign(np.zeros(512, np.float32))
    s3_server.traffic.clear()
    ckpt.Saver(wanted).restore(url)
    assert all(v.numpy()[0] == int(k[1:]) for k, v in wanted.items())
    data = [g for g in s3_server.traffic.gets() if "/.ckpt-data/" in g[1]][len(opening):]
    assert len(data) == 2 and all(g[2].startswith("bytes=") for g in data)
    assert sum(g[3] for g in data) < 2 * 100 * 2048  # the 100 tensors' 200 KiB and what lies between them


def test_a_commit_record_without_copies_still_opens(s3_bucket, s3_server):
    """Records written before they carried the data's head and tail: two more ranged GETs."""
    v = ckpt.Variable(np.arange(70000, dtype=np.float32), name="w")
    url = ckpt.Saver([v], format="msgpack").save(f"{s3_bucket}/run/m.msgpack")
    directory = _remote.RemoteDirectory(f"{s3_bucket}/run")
    data, size, _ = directory.locate("m.msgpack")
    directory.store.delete([url])
    directory.store.put(url, _remote.commit_record(data.rpartition("/run/")[2], size), create_only=True)
    s3_server.traffic.clear()
    np.testing.assert_array_equal(ckpt.load_variable(url, "w"), v.numpy())
    assert sum("/.ckpt-data/" in g[1] for g in s3_server.traffic.gets()) == 3  # head, tail, the tensor


# -- the command line --------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["msgpack", "hdf5"])
def test_an_index_larger_than_the_copied_tail_is_fetched(fmt, s3_bucket, s3_server):
    """3,000 keys: the index is well over the commit record's 64 KiB copy of the data's tail."""
    values = {f"block{i:04d}/weights_with_a_long_name": ckpt.Variable(np.full(3, i, np.int32)) for i in range(3000)}
    url = ckpt.Saver(values, format=fmt).save(f"{s3_bucket}/run/many")
    s3_server.traffic.clear()
    with ckpt.load_checkpoint(url) as reader:
        assert len(reader.keys()) == 3000
        assert any("/.ckpt-data/" in g[1] for g in s3_server.traffic.gets())  # the rest of the index
        assert reader.get_tensor("block2999/weights_with_a_long_name").tolist() == [2999] * 3
    assert all(g[2].startswith("bytes=") for g in s3_server.traffic.gets())
    for v in values.values():
        v.assign(np.zeros(3, np.int32))
    ckpt.Saver(values, format=fmt).restore(url)
    assert values["block1234/weights_with_a_long_name"].numpy().tolist() == [1234] * 3


def test_a_commit_record_longer_than_the_first_get_is_read_whole(s3_bucket):
    import json

    v = ckpt.Variable(np.arange(5, dtype=np.int64), name="w")
    url = ckpt.Saver([v], format="msgpack").save(f"{s3_bucket}/run/m.msgpack")
    store = _remote.RemoteDirectory(f"{s3_bucket}/run").store
    doc = json.loads(store.read_small(url, 1 << 20, "x"))
    doc["comment"] = "x" * (_remote.HEAD_BYTES + 10)  # unknown fields are ignored
    store.delete([url])
    store.put(url, json.dumps(doc).encode(), create_only=True)
    assert ckpt.load_variable(url, "w").tolist() == [0, 1, 2, 3, 4]


def test_cli_on_s3_urls(s3_bucket):
    from ckpt.cli import main

    v = ckpt.Variable(np.arange(3, dtype=np.int64), name="enc/w")
    url = ckpt.Saver([v], format="msgpack").save(f"{s3_bucket}/run/model", global_step=1)
    runner = CliRunner()
    out = runner.invoke(main, ["inspect", f"{s3_bucket}/run", "--names-only"])
    assert out.exit_code == 0 and out.stdout.split() == ["enc/w"]  # "# checkpoint: URL" goes to stderr
    assert out.stderr.strip() == f"# checkpoint: {url}"
    out = runner.invoke(main, ["verify", url])
    assert out.exit_code == 0, out.output
    out = runner.invoke(main, ["diff", url, f"{s3_bucket}/run"])
    assert out.exit_code == 0, out.output
    out = runner.invoke(main, ["ls", f"{s3_bucket}/run"])
    assert out.exit_code == 0 and "model-1.msgpack" in out.output and "latest" in out.output, out.output
    out = runner.invoke(main, ["convert", url, f"{s3_bucket}/copy/model.h5"])
    assert out.exit_code == 0, out.output
    assert ckpt.load_variable(f"{s3_bucket}/copy/model.h5", "enc/w").tolist() == [0, 1, 2]
    out = runner.invoke(main, ["convert", url, f"{s3_bucket}/copy/model.h5"])
    assert out.exit_code == 1 and "create-only" in out.output
    out = runner.invoke(main, ["inspect", f"{s3_bucket}/run/missing.msgpack"])
    assert out.exit_code == 1 and "missing.msgpack" in out.output and "Traceback" not in out.output


def test_async_save_to_s3_commits_the_snapshot(s3_bucket):
    v = ckpt.Variable(np.arange(1000, dtype=np.float32), name="v")
    saver = ckpt.Saver([v], format="msgpack")
    future = saver.save(f"{s3_bucket}/run/model", global_step=1, blocking=False)
    v.assign(np.zeros(1000, np.float32))  # training goes on; the checkpoint keeps the snapshot
    assert future.result() == f"{s3_bucket}/run/model-1.msgpack"
    assert ckpt.load_variable(f"{s3_bucket}/run", "v").tolist() == list(range(1000))
    saver.save(f"{s3_bucket}/run/model", global_step=1, blocking=False)  # a duplicate: refused
    with pytest.raises(ckpt.CheckpointWriteError, match="model-1.msgpack: .*create-only"):
        saver.wait()


def test_init_from_checkpoint_on_s3(s3_bucket):
    with ckpt.name_scope("old"):
        w = ckpt.Variable([1.0, 2.0], name="w")
    ckpt.Saver([w], format="msgpack").save(f"{s3_bucket}/pre/model.msgpack")
    with ckpt.name_scope("new"):
        w2 = ckpt.Variable([0.0, 0.0], name="w")
    ckpt.init_from_checkpoint(f"{s3_bucket}/pre", {"old/": "new/"})
    assert w2.numpy().tolist() == [1.0, 2.0]


def test_wrong_credentials_and_denied_access_name_the_url(s3_bucket, monkeypatch):
    import boto3
    import moto.settings

    iam = boto3.client("iam")
    user = f"nobody-{s3_bucket[-12:]}"
    iam.create_user(UserName=user)
    key = iam.create_access_key(UserName=user)["AccessKey"]  # valid keys, no policy: no rights
    v = ckpt.Variable([1.0], name="v")
    url = ckpt.Saver([v], format="msgpack").save(f"{s3_bucket}/run/m.msgpack")
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server checks from now on
    wrong = {"key": "AKIAWRONGWRONGWRONG1", "secret": "nope"}
    with pytest.raises(ckpt.StorageError, match=f"{url}: .*access denied"):
        ckpt.load_checkpoint(url, storage_options=wrong)
    denied = {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
    with pytest.raises(ckpt.StorageError, match=f"{url}: .*access denied"):
        ckpt.load_checkpoint(url, storage_options=denied)
    with pytest.raises(ckpt.CheckpointWriteError, match=f"{s3_bucket}/run/m2.msgpack: .*access denied"):
        ckpt.Saver([v], storage_options=denied).save(f"{s3_bucket}/run/m2.msgpack")
    monkeypatch.undo()
    assert [k for k in _keys(s3_bucket) if "m2" in k] == []  # nothing committed


def test_a_damaged_state_object_falls_back_to_the_verified_checkpoints(s3_bucket):
    """A 0-byte (or non-JSON) state object: readers go by the committed checkpoints, with a warning;
    the next save rewrites the state object and keeps them (retention counts them)."""
    import boto3

    run = f"{s3_bucket}/run"
    var = ckpt.Variable(0.0)
    saver = ckpt.Saver({"w": var}, max_to_keep=2)
    for step in (1, 5):
        var.assign(float(step))
        saver.save(f"{run}/model.msgpack", global_step=step)
    for damage in (b"", b"{\"format\": \"ckpt-st"):
        boto3.client("s3").put_object(Bucket=s3_bucket[5:], Key="run/checkpoint", Body=damage)
        with pytest.warns(ckpt.StateFileWarning, match="found 2 checkpoint.*'model-5.msgpack'"):
            assert ckpt.latest_checkpoint(run) == f"{run}/model-5.msgpack"
    var.assign(0.0)
    with pytest.warns(ckpt.StateFileWarning):
        assert ckpt.Saver({"w": var}).restore(run).path == f"{run}/model-5.msgpack"
    assert float(var.numpy()) == 5.0
    with pytest.warns(ckpt.StateFileWarning):
        assert [(r.path, r.step, r.note) for r in ckpt.list_checkpoints(run)] == [
            ("model-1.msgpack", 1, ""), ("model-5.msgpack", 5, "latest")]
    with pytest.warns(ckpt.StateFileWarning):
        saver.save(f"{run}/model.msgpack", global_step=6)
    assert [e.path for e in _remote.RemoteDirectory(run).read_state().checkpoints] == [
        "model-5.msgpack", "model-6.msgpack"]
    assert _remote.RemoteDirectory(run).list_names() == ["checkpoint", "model-5.msgpack", "model-6.msgpack"]
