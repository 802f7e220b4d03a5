"""Saves streamed into S3 (ckpt.storage.objstore.S3Upload) against moto's server, both ways an object
goes up: one PUT (up to SINGLE_PUT_MAX, the writer's buffers lent, not copied) and a multipart
upload. The object is byte-for-byte what a local save writes, nothing is visible before it is
complete, a second writer is refused, and a failed writer leaves no object and no upload behind."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import pathlib

import numpy as np
import pytest

import ckpt
from ckpt.storage import objstore as _objstore, remote as _remote
from ckpt.formats._io import crc32c

pytest.importorskip("s3fs")

MiB = 1 << 20
ONE_PUT, MULTIPART = "one PUT", "multipart"


@pytest.fixture
def small_parts(monkeypatch):
    """5 MiB parts (S3's smallest), 2 in flight: a few MiB make a multipart upload, and an upload
    sent as one PUT holds at most 20 MiB of copies."""
    monkeypatch.setattr(_objstore, "UPLOAD_PART", 5 * MiB)
    monkeypatch.setattr(_objstore, "UPLOADS_IN_FLIGHT", 2)


@pytest.fixture(params=[ONE_PUT, MULTIPART])
def mode(request, small_parts, monkeypatch):
    """Each test twice: objects up to SINGLE_PUT_MAX as one PUT, and every object multipart."""
    if request.param == MULTIPART:
        monkeypatch.setattr(_objstore, "SINGLE_PUT_MAX", 0)
    return request.param


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
    store = _objstore.ObjectStore(s3_bucket)
    url = f"{s3_bucket}/blob"
    rng = np.random.default_rng(0)
    body = rng.bytes(23 * MiB + 12345)
    blob = store.open_upload(url, create_only=True)
    assert isinstance(blob, _objstore.S3Upload) and isinstance(blob, ckpt.storage.WritableBlob)
    blob.write_at(b"\0" * 100, 0)  # the head: reserved first ...
    pos = 100
    for start in range(0, len(body), 3 * MiB + 7):  # ... then the rest front to back, with a gap
        piece = body[start:start + 3 * MiB + 7]
        if mode == ONE_PUT:  # 23 MiB lent: not copied, so within the 20 MiB of copies one PUT may hold
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


def test_one_put_holds_copies_up_to_a_bound_then_goes_multipart(s3_server, s3_bucket, small_parts):
    store = _objstore.ObjectStore(s3_bucket)
    url = f"{s3_bucket}/blob"
    body = np.random.default_rng(3).bytes(26 * MiB)
    blob = store.open_upload(url, create_only=True)
    blob.write_at(b"head", 0)
    blob.write_at(body[:19 * MiB], 4)  # copied: 19 MiB held, under the 20 MiB bound
    assert blob.single
    blob.write_at(body[19 * MiB:], 4 + 19 * MiB)  # past it: what is held goes out in parts
    assert not blob.single and _uploads(s3_bucket) == ["blob"]
    blob.finish()
    assert _object(url) == b"head" + body and _uploads(s3_bucket) == []


def test_an_object_over_single_put_max_goes_multipart(s3_server, s3_bucket, small_parts, monkeypatch):
    monkeypatch.setattr(_objstore, "SINGLE_PUT_MAX", 12 * MiB)
    store = _objstore.ObjectStore(s3_bucket)
    url = f"{s3_bucket}/blob"
    body = np.random.default_rng(4).bytes(13 * MiB)
    blob = store.open_upload(url, create_only=True)
    blob.write_at(b"head", 0)
    blob.lend_pieces([body[:12 * MiB - 4]], 4)  # lent, and exactly SINGLE_PUT_MAX: still one PUT
    assert blob.single
    blob.lend_pieces([body[12 * MiB - 4:]], 12 * MiB)
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
    body = _objstore._Held(segments, len(expected))
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
    many = _objstore._Held(pieces + [(700_000, memoryview(bytes(300_000)))], 1_000_000)

    async def collect():
        return [bytes(v) async for v in many]

    chunks = asyncio.run(collect())
    assert b"".join(chunks) == b"".join(bytes(v) for _, v in pieces) + bytes(300_000)
    assert [len(c) for c in chunks] == [263_000, 263_000, 474_000]  # 1000-byte pieces joined past 256 KiB
    assert _objstore._Held([], 5).read() == bytes(5) and _objstore._Held([], 0).crc32c() == crc32c(b"")


def test_ckpt_sends_its_own_crc32c_only_where_botocore_would_compute_one_in_a_header():
    from types import SimpleNamespace as NS

    def client(endpoint, setting="when_supported"):
        return NS(meta=NS(endpoint_url=endpoint, config=NS(request_checksum_calculation=setting)))

    assert _objstore._sends_own_checksum(client("http://127.0.0.1:9000"))
    assert not _objstore._sends_own_checksum(client("https://s3.amazonaws.com"))  # botocore: unsigned trailer
    assert not _objstore._sends_own_checksum(client("http://127.0.0.1:9000", "when_required"))
    assert not _objstore._sends_own_checksum(NS(meta=NS(endpoint_url="http://x", config=NS())))  # old botocore
    assert not _objstore._sends_own_checksum(None)


def test_a_write_going_back_past_the_head_is_refused(s3_bucket, mode):
    blob = _objstore.ObjectStore(s3_bucket).open_upload(f"{s3_bucket}/blob", create_only=True)
    blob.write_at(b"head", 0)
    blob.write_at(bytes(6 * MiB), 5 * MiB)
    with pytest.raises(ValueError, match="goes back"):
        blob.write_at(b"x", 6 * MiB)
    blob.abort()
    assert _uploads(s3_bucket) == [] and _client().list_objects_v2(Bucket=s3_bucket[5:]).get("KeyCount") == 0


@pytest.mark.parametrize("size", [1000, 12 * MiB])
def test_an_upload_is_create_only(s3_bucket, mode, size):
    store = _objstore.ObjectStore(s3_bucket)
    url = f"{s3_bucket}/blob"
    store.put(url, b"first", create_only=True)
    blob = store.open_upload(url, create_only=True)
    blob.write_at(b"x" * size, 0)
    with pytest.raises(ckpt.CheckpointWriteError, match="create-only.*nothing was committed"):
        blob.finish()
    assert _object(url) == b"first" and _uploads(s3_bucket) == []


@pytest.mark.parametrize("ext", [".msgpack", ".h5", ".safetensors"])
def test_a_save_to_s3_is_the_bytes_of_a_local_save(s3_server, s3_bucket, mode, tmp_path, ext):
    rng = np.random.default_rng(1)
    tensors = {f"small/{i}": rng.standard_normal(50).astype(np.float32) for i in range(300)}
    tensors.update({f"big/{i}": rng.standard_normal(3 * MiB // 4 + i).astype(np.float32) for i in range(5)})
    tensors["huge"] = rng.standard_normal(6 * MiB).astype(np.float32)  # 24 MiB: lent, over the copies' bound
    variables = {k: ckpt.Variable(v) for k, v in tensors.items()}
    local = ckpt.Saver(variables).save(str(tmp_path / f"model{ext}"))
    s3_server.traffic.clear()
    url = ckpt.Saver(variables).save(f"{s3_bucket}/run/model{ext}")
    methods = [m for m, _ in _data_requests(s3_server)]
    data, size, copies = _remote.RemoteDirectory(f"{s3_bucket}/run").locate(f"model{ext}")
    expected = pathlib.Path(local).read_bytes()
    assert size == len(expected) > 38 * MiB  # several parts, more than one PUT may hold in copies
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


def test_a_conversion_to_s3_copies_lazy_sources_and_goes_multipart_past_the_bound(s3_server, s3_bucket, small_parts,
                                                                                tmp_path):
    rng = np.random.default_rng(6)
    tensors = {f"w{i}": rng.standard_normal(MiB).astype(np.float32) for i in range(7)}  # 28 MiB
    source = str(tmp_path / "src.msgpack")
    ckpt.save_file(tensors, source)
    s3_server.traffic.clear()
    ckpt.convert(source, f"{s3_bucket}/run/m.msgpack")  # lazy sources, not lent: copies past 20 MiB
    assert "POST" in [m for m, _ in _data_requests(s3_server)]
    local = str(tmp_path / "local.msgpack")
    ckpt.convert(source, local)
    data, _, _ = _remote.RemoteDirectory(f"{s3_bucket}/run").locate("m.msgpack")
    assert _object(data) == pathlib.Path(local).read_bytes()


def test_an_async_save_lends_its_snapshot(s3_server, s3_bucket, small_parts, tmp_path):
    rng = np.random.default_rng(7)
    values = {f"w{i}": rng.standard_normal(MiB).astype(np.float32) for i in range(7)}
    variables = {k: ckpt.Variable(v) for k, v in values.items()}
    saver = ckpt.Saver(variables, format="msgpack")
    s3_server.traffic.clear()
    future = saver.save(f"{s3_bucket}/run/model", global_step=1, blocking=False)
    for var in variables.values():  # training goes on: the checkpoint holds the values of the call
        var.assign(np.zeros(MiB, np.float32))
    url = future.result()
    assert [m for m, _ in _data_requests(s3_server)] == ["PUT"]  # 28 MiB of staged arrays, lent
    loaded = ckpt.load_file(url)
    assert sorted(loaded) == sorted(values) and all(np.array_equal(loaded[k], v) for k, v in values.items())


def test_a_save_failing_midway_leaves_no_object_and_no_upload(s3_bucket, mode, monkeypatch):
    from ckpt.formats import msgpack

    variables = {f"w{i}": ckpt.Variable(np.full(MiB, float(i), np.float32)) for i in range(8)}
    saver = ckpt.Saver(variables, format="msgpack")
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


def test_the_next_save_aborts_the_unfinished_upload_of_a_killed_save(s3_bucket, small_parts, monkeypatch):
    monkeypatch.setattr(_objstore, "SINGLE_PUT_MAX", 0)  # multipart: one PUT leaves nothing behind
    run = f"{s3_bucket}/run"
    directory = _remote.RemoteDirectory(run)
    blob = directory.store.open_upload(directory.join(directory.new_data("m.msgpack")), create_only=True)
    blob.write_at(b"head", 0)
    blob.write_at(bytes(6 * MiB), 5 * MiB)  # a part went up: the upload exists; then the process "dies"
    assert len(_uploads(s3_bucket)) == 1
    saver = ckpt.Saver({"w": ckpt.Variable(np.ones(3))}, format="msgpack")
    saver.save(f"{run}/model", global_step=1)
    assert len(_uploads(s3_bucket)) == 1  # young: it may be a save in progress
    monkeypatch.setattr(_remote, "ORPHAN_GRACE_S", -1.0)
    saver.save(f"{run}/model", global_step=2)
    assert _uploads(s3_bucket) == []
    assert ckpt.latest_checkpoint(run) == f"{run}/model-2.msgpack"
