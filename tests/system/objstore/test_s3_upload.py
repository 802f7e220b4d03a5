"""Saves streamed into S3 (ckpt.storage.uploads.S3Upload) against moto's server, both ways an object
goes up: one PUT (up to ``single_put_max``, the writer's buffers lent, not copied) and a multipart
upload. Sizes are 1/16 of real ones (``UNIT`` stands for a MiB; parts of 5 UNIT, the server's
smallest), passed as storage options, so every test moves a few UNIT at most. The object is
byte-for-byte what a local save writes, nothing is visible before it is
complete, a second writer is refused, and a failed writer leaves no object and no upload behind."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import pathlib
import time

import numpy as np
import pytest

import ckpt
from ckpt.checksums import crc32c
from ckpt.storage import remote as _remote, s3upload as upload_module
from ckpt.storage.backends import object_store
from s3server import MIN_PART

pytest.importorskip("s3fs")

UNIT = 1 << 16  # what a UNIT is to real stores
ONE_PUT, MULTIPART = "one PUT", "multipart"


#: Parts of 5 UNIT (the server's smallest), 2 in flight: a few UNIT make a multipart upload, and an
#: upload sent as one PUT holds at most 20 UNIT of copies.
SMALL_PARTS = {"ckpt_upload_part": MIN_PART, "ckpt_uploads_in_flight": 2}
#: ... and every object a multipart upload.
ALL_MULTIPART = {**SMALL_PARTS, "ckpt_single_put_max": 0}


@pytest.fixture(params=[ONE_PUT, MULTIPART])
def mode(request):
    """Each test twice: objects up to ``single_put_max`` as one PUT, and every object multipart."""
    return request.param


def options(mode: str) -> dict[str, int]:
    """The storage options of ``mode``."""
    return ALL_MULTIPART if mode == MULTIPART else SMALL_PARTS


def store(bucket: str, mode: str = ONE_PUT):
    """The S3 store of ``bucket`` with the sizes of ``mode``."""
    return object_store(bucket, options(mode))


def _client():
    import boto3

    return boto3.client("s3")


def _uploads(bucket_url: str) -> list[str]:
    """Multipart uploads begun and neither completed nor aborted."""
    resp = _client().list_multipart_uploads(Bucket=bucket_url[5:])
    return [u["Key"] for u in resp.get("Uploads", [])]


def _object(url: str) -> bytes:
    bucket, _, key = url[5:].partition("/")
    return _client().get_object(Bucket=bucket, Key=key)["Body"].read()


def _data_requests(server) -> list[tuple[str, str]]:
    """(method, query) of the requests that wrote data objects: one PUT, or POST/PUTs of an upload."""
    return [(method, path) for method, path, _, _ in server.traffic.requests
            if "/.ckpt-data/" in path or path.endswith("/blob")]


def test_an_upload_keeps_the_blob_write_order_and_patches_the_head_last(s3_server, s3_bucket, mode):
    blobs = store(s3_bucket, mode)
    url = f"{s3_bucket}/blob"
    rng = np.random.default_rng(0)
    body = rng.bytes(23 * UNIT + 12345)
    blob = blobs.open_upload(url, create_only=True)
    assert isinstance(blob, upload_module.S3Upload) and isinstance(blob, ckpt.storage.WritableBlob)
    blob.write_at(b"\0" * 100, 0)  # the head: reserved first ...
    pos = 100
    for start in range(0, len(body), 3 * UNIT + 7):  # ... then the rest front to back, with a gap
        piece = body[start:start + 3 * UNIT + 7]
        if mode == ONE_PUT:  # 23 UNIT lent: not copied, so within the 20 UNIT of copies one PUT may hold
            blob.lend_pieces([piece[:10], memoryview(piece)[10:]], pos)
        else:
            blob.write_pieces([piece[:10], memoryview(piece)[10:]], pos)
        pos += len(piece)
    blob.write_at(b"tail", pos + 1000)  # 1000 bytes never written: zeros
    assert _client().list_objects_v2(Bucket=s3_bucket[5:]).get("KeyCount") == 0  # nothing visible yet
    blob.write_at(b"H" * 100, 0)  # ... and filled in last
    assert blob.single == (mode == ONE_PUT)
    s3_server.traffic.clear()
    size, head, tail = blob.finish()
    methods = [m for m, _ in _data_requests(s3_server)]
    expected = b"H" * 100 + body + bytes(1000) + b"tail"
    assert size == len(expected) and _object(url) == expected
    assert head == expected[:_remote.OPEN_HEAD] and tail == expected[-_remote.OPEN_TAIL:]
    assert _uploads(s3_bucket) == []
    if mode == ONE_PUT:  # the whole object in one request, sent from the lent buffers
        assert methods == ["PUT"]


def test_one_put_holds_copies_up_to_a_bound_then_goes_multipart(s3_server, s3_bucket):
    url = f"{s3_bucket}/blob"
    body = np.random.default_rng(3).bytes(26 * UNIT)
    blob = store(s3_bucket).open_upload(url, create_only=True)
    blob.write_at(b"head", 0)
    blob.write_at(body[:19 * UNIT], 4)  # copied: 19 UNIT held, under the 20 UNIT bound
    assert blob.single
    blob.write_at(body[19 * UNIT:], 4 + 19 * UNIT)  # past it: what is held goes out in parts
    assert not blob.single and _uploads(s3_bucket) == ["blob"]
    blob.finish()
    assert _object(url) == b"head" + body and _uploads(s3_bucket) == []


def test_an_object_over_single_put_max_goes_multipart(s3_server, s3_bucket):
    url = f"{s3_bucket}/blob"
    body = np.random.default_rng(4).bytes(13 * UNIT)
    blob = object_store(s3_bucket, {**SMALL_PARTS, "ckpt_single_put_max": 12 * UNIT}).open_upload(url, create_only=True)
    blob.write_at(b"head", 0)
    blob.lend_pieces([body[:12 * UNIT - 4]], 4)  # lent, and exactly single_put_max: still one PUT
    assert blob.single
    blob.lend_pieces([body[12 * UNIT - 4:]], 12 * UNIT)
    assert not blob.single
    s3_server.traffic.clear()
    blob.finish()
    assert [m for m, _ in _data_requests(s3_server)][-1] == "POST"  # completed as a multipart upload
    assert _object(url) == b"head" + body


def test_the_held_body_reads_like_the_bytes_it_stands_for():
    rng = np.random.default_rng(5)
    expected = bytearray(3000)
    segments = []
    for offset, n in [(0, 10), (10, 700), (900, 1), (901, 1000), (2500, 300)]:  # gaps at 710 and 2800
        data = rng.bytes(n)
        expected[offset:offset + n] = data
        segments.append((offset, memoryview(data)))
    body = upload_module._Held(segments, len(expected))
    assert body.read() == bytes(expected) and body.read(5) == b""
    for start, step in [(0, 1), (3, 97), (700, 211), (2799, 5), (0, 4096)]:
        body.seek(start)
        got = b"".join(iter(functools.partial(body.read, step), b""))
        assert got == bytes(expected[start:])
    assert body.pread(705, 300) == bytes(expected[705:1005]) and body.tell() == len(expected)
    assert body.crc32c() == crc32c(bytes(expected))

    async def sent(start):  # what aiohttp sends: views of the segments from the position on
        body.seek(start)
        return [bytes(view) for view in [v async for v in body]]

    for start in (0, 5, 705, 2999, 3000):
        assert b"".join(asyncio.run(sent(start))) == bytes(expected[start:])
    pieces = [(i * 1000, memoryview(bytes([i % 251]) * 1000)) for i in range(700)]  # small tensors: sent joined
    many = upload_module._Held(pieces + [(700_000, memoryview(bytes(300_000)))], 1_000_000)

    async def collect():
        return [bytes(v) async for v in many]

    chunks = asyncio.run(collect())
    assert b"".join(chunks) == b"".join(bytes(v) for _, v in pieces) + bytes(300_000)
    assert [len(c) for c in chunks] == [263_000, 263_000, 474_000]  # 1000-byte pieces joined past 256 KiB
    assert upload_module._Held([], 5).read() == bytes(5) and upload_module._Held([], 0).crc32c() == crc32c(b"")


def test_ckpt_sends_its_own_crc32c_only_where_botocore_would_compute_one_in_a_header():
    from types import SimpleNamespace as NS

    def client(endpoint, setting="when_supported"):
        return NS(meta=NS(endpoint_url=endpoint, config=NS(request_checksum_calculation=setting)))

    assert upload_module._sends_own_checksum(client("http://127.0.0.1:9000"))
    assert not upload_module._sends_own_checksum(client("https://s3.amazonaws.com"))  # botocore: unsigned trailer
    assert not upload_module._sends_own_checksum(client("http://127.0.0.1:9000", "when_required"))
    assert not upload_module._sends_own_checksum(NS(meta=NS(endpoint_url="http://x", config=NS())))  # old botocore
    assert not upload_module._sends_own_checksum(None)


def test_a_write_going_back_past_the_head_is_refused(s3_bucket, mode):
    blob = store(s3_bucket, mode).open_upload(f"{s3_bucket}/blob", create_only=True)
    blob.write_at(b"head", 0)
    blob.write_at(bytes(6 * UNIT), 5 * UNIT)
    with pytest.raises(ValueError, match="goes back"):
        blob.write_at(b"x", 6 * UNIT)
    blob.abort()
    assert _uploads(s3_bucket) == [] and _client().list_objects_v2(Bucket=s3_bucket[5:]).get("KeyCount") == 0


@pytest.mark.parametrize("size", [1000, 12 * UNIT])
def test_an_upload_is_create_only(s3_bucket, mode, size):
    blobs = store(s3_bucket, mode)
    url = f"{s3_bucket}/blob"
    blobs.put(url, b"first", create_only=True)
    blob = blobs.open_upload(url, create_only=True)
    blob.write_at(b"x" * size, 0)
    with pytest.raises(ckpt.CheckpointWriteError, match="create-only.*nothing was committed"):
        blob.finish()
    assert _object(url) == b"first" and _uploads(s3_bucket) == []


@pytest.mark.parametrize("ext", [".msgpack", ".h5", ".safetensors"])
def test_a_save_to_s3_is_the_bytes_of_a_local_save(s3_server, s3_bucket, mode, tmp_path, ext):
    rng = np.random.default_rng(1)
    tensors = {f"small/{i}": rng.standard_normal(50).astype(np.float32) for i in range(40)}  # runs of small ones
    tensors.update({f"big/{i}": rng.standard_normal(3 * UNIT // 4 + i).astype(np.float32) for i in range(5)})
    tensors["huge"] = rng.standard_normal(6 * UNIT).astype(np.float32)  # 24 UNIT: lent, over the copies' bound
    variables = {k: ckpt.Variable(v) for k, v in tensors.items()}
    local = ckpt.Saver(variables).save(str(tmp_path / f"model{ext}"))
    s3_server.traffic.clear()
    url = ckpt.Saver(variables, storage_options=options(mode)).save(f"{s3_bucket}/run/model{ext}")
    methods = [m for m, _ in _data_requests(s3_server)]
    data, size, copies = _remote.RemoteDirectory(f"{s3_bucket}/run").locate(f"model{ext}")
    expected = pathlib.Path(local).read_bytes()
    assert size == len(expected) > 38 * UNIT  # several parts, more than one PUT may hold in copies
    assert hashlib.sha256(_object(data)).hexdigest() == hashlib.sha256(expected).hexdigest()
    assert all(expected[offset:offset + len(copy)] == copy for offset, copy in copies)
    with ckpt.load_checkpoint(url) as reader:
        assert reader.verify() == []
    assert _uploads(s3_bucket) == []
    if mode == ONE_PUT:  # the variables' buffers were lent to the upload: one request
        assert methods == ["PUT"]
        bucket, _, key = data[5:].partition("/")
        stored = _client().head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        assert stored["ChecksumCRC32C"] == base64.b64encode(crc32c(expected).to_bytes(4, "big")).decode()
    else:
        assert methods.count("POST") == 2 and len(methods) > 4  # created, parts, completed


def test_a_conversion_to_s3_copies_lazy_sources_and_goes_multipart_past_the_bound(s3_server, s3_bucket, tmp_path):
    rng = np.random.default_rng(6)
    tensors = {f"w{i}": rng.standard_normal(UNIT).astype(np.float32) for i in range(7)}  # 28 UNIT
    source = str(tmp_path / "src.msgpack")
    ckpt.save_file(tensors, source)
    s3_server.traffic.clear()
    # lazy sources, not lent: copies past 20 UNIT
    ckpt.convert(source, f"{s3_bucket}/run/m.msgpack", storage_options=SMALL_PARTS)
    assert "POST" in [m for m, _ in _data_requests(s3_server)]
    local = str(tmp_path / "local.msgpack")
    ckpt.convert(source, local)
    data, _, _ = _remote.RemoteDirectory(f"{s3_bucket}/run").locate("m.msgpack")
    assert _object(data) == pathlib.Path(local).read_bytes()


def test_an_async_save_lends_its_snapshot(s3_server, s3_bucket, tmp_path):
    rng = np.random.default_rng(7)
    values = {f"w{i}": rng.standard_normal(UNIT).astype(np.float32) for i in range(7)}
    variables = {k: ckpt.Variable(v) for k, v in values.items()}
    saver = ckpt.Saver(variables, format="msgpack", storage_options=SMALL_PARTS)
    s3_server.traffic.clear()
    future = saver.save(f"{s3_bucket}/run/model", global_step=1, blocking=False)
    for var in variables.values():  # training goes on: the checkpoint holds the values of the call
        var.assign(np.zeros(UNIT, np.float32))
    url = future.result()
    assert [m for m, _ in _data_requests(s3_server)] == ["PUT"]  # 28 UNIT of staged arrays, lent
    loaded = ckpt.load_file(url)
    assert sorted(loaded) == sorted(values) and all(np.array_equal(loaded[k], v) for k, v in values.items())


def test_a_save_failing_midway_leaves_no_object_and_no_upload(s3_bucket, mode, monkeypatch):
    from ckpt.formats import _mpwrite as msgpack  # the writer computes the checksums

    variables = {f"w{i}": ckpt.Variable(np.full(UNIT, float(i), np.float32)) for i in range(8)}
    saver = ckpt.Saver(variables, format="msgpack", storage_options=options(mode))
    saver.save(f"{s3_bucket}/run/model", global_step=1)
    calls = []
    real = msgpack.checksums

    def failing(view, block_bytes):  # the 6th tensor's checksum: after parts went up (multipart)
        calls.append(1)
        if len(calls) == 6:
            raise OSError(5, "Input/output error")
        return real(view, block_bytes)

    monkeypatch.setattr(msgpack, "checksums", failing)
    with pytest.raises(OSError, match="Input/output"):
        saver.save(f"{s3_bucket}/run/model", global_step=2)
    assert ckpt.latest_checkpoint(f"{s3_bucket}/run") == f"{s3_bucket}/run/model-1.msgpack"
    keys = sorted(o["Key"] for o in _client().list_objects_v2(Bucket=s3_bucket[5:])["Contents"])
    assert [k for k in keys if "model-2" in k] == [] and _uploads(s3_bucket) == []


# -- sharded conversions into an object store (ckpt.convert(..., shards=N) to a URL) -----------------

def _all_keys(bucket_url: str) -> list[str]:
    resp = _client().list_objects_v2(Bucket=bucket_url[5:])
    return sorted(o["Key"] for o in resp.get("Contents", []))


@pytest.mark.parametrize("ext", [".msgpack", ".h5"])
def test_convert_to_s3_in_shards(s3_bucket, tmp_path, ext):
    rng = np.random.default_rng(2)
    tensors = {"w": rng.standard_normal((10, 3)).astype(np.float32), "b": np.arange(7, dtype=np.int64),
               "s": np.float64(2.5)}
    source = str(tmp_path / "src.h5")
    ckpt.save_file(tensors, source, metadata={"step": 4})
    dst = f"{s3_bucket}/run/sharded{ext}"
    done = ckpt.convert(source, dst, shards=3)
    assert done.shards == 3
    keys = _all_keys(s3_bucket)
    data = [k for k in keys if k.startswith("run/.ckpt-data/")]
    assert "run/sharded" + ext in keys and len(data) == 4  # 3 shard files and the COMMIT
    assert [k.rpartition("/")[2] for k in data if not k.endswith(ext)] == ["COMMIT"]
    loaded = ckpt.load_file(dst)
    assert sorted(loaded) == sorted(tensors) and all(np.array_equal(loaded[k], v) for k, v in tensors.items())
    with ckpt.load_checkpoint(dst) as reader:
        assert reader.metadata == {"step": 4} and reader.verify() == []
    with pytest.raises(ckpt.CheckpointWriteError, match="exists"):
        ckpt.convert(source, dst, shards=2)
    assert _all_keys(s3_bucket) == keys and _uploads(s3_bucket) == []


def test_a_sharded_conversion_to_s3_reads_back_with_the_storage_options_it_was_given(s3_bucket, tmp_path,
                                                                                     monkeypatch):
    """The read-back of the written shards goes through the same options as the writes (the
    endpoint comes only from storage_options here)."""
    import os

    options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # without the options, nothing reaches the test server
    source = str(tmp_path / "src.h5")
    tensors = {"w": np.arange(12, dtype=np.float32).reshape(4, 3)}
    ckpt.save_file(tensors, source)
    dst = f"{s3_bucket}/run/m.msgpack"
    assert ckpt.convert(source, dst, shards=2, storage_options=options).shards == 2
    with ckpt.load_checkpoint(dst, storage_options=options) as reader:
        assert np.array_equal(reader.get_tensor("w"), tensors["w"]) and reader.verify() == []


def test_a_sharded_conversion_to_s3_that_does_not_read_back_commits_nothing(s3_bucket, tmp_path, monkeypatch):
    from ckpt.tools import conversion

    source = str(tmp_path / "src.h5")
    ckpt.save_file({"w": np.ones((4, 2))}, source)

    def differ(*args):
        raise ckpt.CheckpointWriteError("tensor 'w' does not read back as written")

    monkeypatch.setattr(conversion, "_check_sharded", differ)
    with pytest.raises(ckpt.CheckpointWriteError, match="does not read back"):
        ckpt.convert(source, f"{s3_bucket}/run/m.msgpack", shards=2)
    assert _all_keys(s3_bucket) == [] and _uploads(s3_bucket) == []


def test_the_next_save_aborts_the_unfinished_upload_of_a_killed_save(s3_bucket):
    run = f"{s3_bucket}/run"
    directory = _remote.RemoteDirectory(run, ALL_MULTIPART)  # multipart: one PUT leaves nothing behind
    # a data name's token starts with its save's start time (ms, hex): one save began now, one 2 hours ago
    old = f"{_remote.DATA_DIR}/m.msgpack/{int((time.time() - 2 * _remote.ORPHAN_GRACE_S) * 1000):012x}-{'0' * 16}"
    for relative in (directory.new_data("m.msgpack"), old):
        blob = directory.store.open_upload(directory.join(relative), create_only=True)
        blob.write_at(b"head", 0)
        blob.write_at(bytes(6 * UNIT), 5 * UNIT)  # a part went up: the upload exists; then the process "dies"
    assert len(_uploads(s3_bucket)) == 2
    saver = ckpt.Saver({"w": ckpt.Variable(np.ones(3))}, format="msgpack")
    saver.save(f"{run}/model", global_step=1)
    young = _uploads(s3_bucket)
    assert len(young) == 1 and old.rpartition("/")[2] not in young[0]  # the young one may be a save in progress
    assert len(directory.clean_orphans(grace_s=0.0)) == 1  # past a shorter grace period it goes too
    assert _uploads(s3_bucket) == []
    assert ckpt.latest_checkpoint(run) == f"{run}/model-1.msgpack"
