"""The object-store layer against moto's S3 server on 127.0.0.1: the conditional writes the
commit protocol relies on, ranged reads, the state file's compare-and-swap, orphan cleanup,
and every store fault as a CheckpointError naming the URL."""

from __future__ import annotations

import dataclasses
import itertools
import socket
import threading
import time
from types import SimpleNamespace

import pytest

import ckpt
from ckpt.storage import remote as _remote, urls as _urls
from ckpt.storage.backends import object_store
from ckpt.storage.commits import unique_token
from ckpt.storage.objstore import Sizes
from ckpt.storage.faults import store_error
from ckpt.storage.state import CheckpointEntry, CheckpointState, parse_state

pytest.importorskip("s3fs")


# -- what the protocol assumes of the store (checked on the server itself) ---------------------

def test_create_only_put_refuses_a_second_writer(s3_bucket):
    import boto3
    import botocore.exceptions

    client, bucket = boto3.client("s3"), s3_bucket[5:]
    client.put_object(Bucket=bucket, Key="k", Body=b"first", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as info:
        client.put_object(Bucket=bucket, Key="k", Body=b"second", IfNoneMatch="*")
    assert info.value.response["Error"]["Code"] == "PreconditionFailed"
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"first"


def test_create_only_multipart_completion_refuses_a_second_writer(s3_bucket):
    """s3fs sends If-None-Match on CompleteMultipartUpload for "xb" files of several parts."""
    fs = _urls.filesystem(s3_bucket)
    path = f"{s3_bucket[5:]}/big"
    for fill in (b"a", b"b"):
        try:
            with fs.open(path, "xb", block_size=5 << 20) as f:
                f.write(fill * (11 << 20))  # three parts
        except FileExistsError:
            assert fill == b"b"
        else:
            assert fill == b"a"
    assert fs.cat_file(path, start=0, end=4) == b"aaaa"


def test_store_put_create_only_and_compare_and_swap(s3_bucket):
    store = object_store(s3_bucket)
    url = f"{s3_bucket}/state"
    assert store.get_versioned(url) == (None, None)
    assert store.put_if(url, b"v1", None)
    assert not store.put_if(url, b"other", None)  # someone created it first
    data, version = store.get_versioned(url)
    assert data == b"v1"
    assert store.put_if(url, b"v2", version)
    assert not store.put_if(url, b"v3", version)  # stale version
    assert store.read_small(url, 100, "x") == b"v2"
    store.put(f"{s3_bucket}/c", b"x", create_only=True)
    with pytest.raises(ckpt.CheckpointWriteError, match=f"{s3_bucket}/c: .*create-only"):
        store.put(f"{s3_bucket}/c", b"y", create_only=True)


def test_ranged_reads_fill_buffers_and_fetch_only_the_ranges(s3_bucket, s3_server, monkeypatch):
    sizes = Sizes(part=1 << 20, chunk=1000)  # small parts, small chunks: the same code on less data
    store = object_store(s3_bucket, sizes=sizes)
    url = f"{s3_bucket}/blob"
    blob = bytes(range(256)) * ((1 << 20) // 256 * 4 + 3)
    store.put(url, blob, create_only=True)
    s3_server.traffic.clear()
    a, b = bytearray(10), bytearray(2 * sizes.part + 100)  # b is cut in two parts: two GETs side by side
    store.read_into(url, [(5, memoryview(a)), (1 << 20, memoryview(b))])
    assert bytes(a) == blob[5:15] and bytes(b) == blob[1 << 20:(1 << 20) + len(b)]
    gets = s3_server.traffic.gets()
    assert len(gets) == 3 and all(g[2].startswith("bytes=") for g in gets)
    assert s3_server.traffic.bytes_sent == len(a) + len(b)
    s3_server.traffic.clear()  # neighbours (gaps up to GAP bytes) cost one request
    small = [(1000 + 300 * i, memoryview(bytearray(100))) for i in range(50)]
    store.read_into(url, small)
    assert all(bytes(v) == blob[o:o + 100] for o, v in small)
    assert len(s3_server.traffic.gets()) == 1
    with pytest.raises(ckpt.CorruptCheckpointError, match="truncated"):
        store.read_into(url, [(len(blob) - 4, memoryview(bytearray(8)))], lambda i: "tensor 'w'")
    assert store.read_small_or_head(url, 64, "x") == (blob[:64], len(blob))


def test_each_span_is_reported_once_as_soon_as_it_is_whole(s3_bucket, monkeypatch):
    """``done(i)`` (where RemoteFile starts span i's checksum) comes once per span, when all of its
    bytes are in place: also for a span cut between two GETs, and before the read ends."""
    store = object_store(s3_bucket)
    url = f"{s3_bucket}/blob"
    blob = bytes(range(251)) * ((3 << 20) // 251)
    store.put(url, blob, create_only=True)
    cuts = [0, 10, 5000, (1 << 20) + 7, (2 << 20) + 3, len(blob) - 9]  # one span crosses parts' edges
    spans = [(a, memoryview(bytearray(b - a))) for a, b in itertools.pairwise(cuts)]
    for part in (1 << 20, 64 << 20):  # three GETs side by side; one GET (filling the spans in order)
        store = object_store(s3_bucket, sizes=Sizes(part=part, chunk=4096))
        for _, view in spans:
            view[:] = bytes(len(view))
        seen: list[tuple[int, bool, bool]] = []  # (span, it is whole, the last span is whole)

        def done(i: int, seen: list[tuple[int, bool, bool]] = seen) -> None:
            whole = [bytes(spans[j][1]) == blob[cuts[j]:cuts[j + 1]] for j in (i, len(spans) - 1)]
            seen.append((i, *whole))

        store.read_into(url, spans, done=done)
        assert sorted(i for i, _, _ in seen) == list(range(len(spans))) and all(whole for _, whole, _ in seen)
    assert seen[0][0] == 0 and not seen[0][2]  # one GET: the first span was reported before the last had come


def test_a_read_of_nearly_a_whole_object_is_one_get_of_all_of_it(s3_bucket, s3_server, monkeypatch):
    sizes = Sizes(part=1 << 20, whole_slack=4096)  # without the whole-object rule: several parts
    store = object_store(s3_bucket, sizes=sizes)
    url = f"{s3_bucket}/blob"
    blob = bytes(range(256)) * (5 << 12)  # 5 MiB
    store.put(url, blob, create_only=True)
    views = [(100 + i * (1 << 20), memoryview(bytearray(1 << 20))) for i in range(4)] + \
        [(100 + (4 << 20), memoryview(bytearray(len(blob) - (4 << 20) - 2000)))]  # all but 2,100 bytes
    s3_server.traffic.clear()
    store.read_into(url, views, size=len(blob))
    assert all(bytes(v) == blob[o:o + len(v)] for o, v in views)
    assert [g[2] for g in s3_server.traffic.gets()] == [f"bytes=0-{len(blob) - 1}"]
    s3_server.traffic.clear()  # the same without the size, or over SINGLE_GET_MAX: ranged parts
    store.read_into(url, views)
    assert len(s3_server.traffic.gets()) > 1 and not any(g[2].startswith("bytes=0-") for g in s3_server.traffic.gets())
    store = object_store(s3_bucket, sizes=dataclasses.replace(sizes, single_get_max=len(blob) - 1))
    s3_server.traffic.clear()
    store.read_into(url, views, size=len(blob))
    assert len(s3_server.traffic.gets()) > 1
    s3_server.traffic.clear()  # more than WHOLE_SLACK bytes unasked: only what is asked
    store = object_store(s3_bucket, sizes=dataclasses.replace(sizes, single_get_max=len(blob)))
    store.read_into(url, views[:4], size=len(blob))
    assert s3_server.traffic.bytes_sent == 4 << 20
    # nor when over 1/16 of the object is unasked
    store = object_store(s3_bucket, sizes=dataclasses.replace(sizes, single_get_max=len(blob), whole_slack=1 << 20))
    s3_server.traffic.clear()
    most = [(100, memoryview(bytearray(len(blob) - (400 << 10))))]
    store.read_into(url, most, size=len(blob))
    assert s3_server.traffic.bytes_sent == len(most[0][1])


@pytest.mark.parametrize("reader", ["readchunk", "read"])
def test_a_connection_dropped_mid_body_is_resumed_where_it_stopped(s3_bucket, s3_server, monkeypatch, reader):
    """Both ways a body is read: aiohttp's chunks as they arrive, and a body's read(n)."""
    import aiohttp

    store = object_store(s3_bucket, sizes=Sizes(chunk=4096))
    url = f"{s3_bucket}/blob"
    blob = bytes(range(256)) * 4096  # 1 MiB
    store.put(url, blob, create_only=True)
    call_s3, delivered = store.fs._call_s3, []

    class Dropping:  # the first GET's connection breaks after two chunks
        def __init__(self, read):
            self.next, self.reads = read, 0

        async def __call__(self, *args):
            self.reads += 1
            if self.reads == 3:
                raise aiohttp.ClientPayloadError("Response payload is not completed")
            got = await self.next(*args)
            delivered.append(len(got[0] if reader == "readchunk" else got))
            return got

    class Body:  # aiohttp's stream behind raw_stream: readchunk() is used; else read(n)
        def __init__(self, body):
            self.body = body
            if reader == "read":
                self.read = Dropping(body.read)
            else:
                self.raw_stream = SimpleNamespace(content=SimpleNamespace(
                    readchunk=Dropping(body.raw_stream.content.readchunk)))

        def close(self):
            self.body.close()

    async def flaky(method, **kwargs):
        resp = await call_s3(method, **kwargs)
        if method == "get_object" and not delivered:
            resp["Body"] = Body(resp["Body"])
        return resp

    monkeypatch.setattr(store.fs, "_call_s3", flaky)
    s3_server.traffic.clear()
    out = bytearray(len(blob) - 100)
    store.read_into(url, [(100, memoryview(out))])
    assert bytes(out) == blob[100:]
    assert [g[2] for g in s3_server.traffic.gets()] == [f"bytes=100-{len(blob) - 1}",
                                                        f"bytes={100 + sum(delivered[:2])}-{len(blob) - 1}"]


# -- the state file under racing writers ---------------------------------------------------------

@pytest.mark.parametrize("where", ["s3", "memory"])
def test_racing_state_updates_lose_no_entry(where, s3_bucket):
    url = s3_bucket + "/run" if where == "s3" else f"memory://race-{time.time_ns()}"
    directory = _remote.RemoteDirectory(url)
    names = _race(directory)
    assert sorted(e.path for e in directory.read_state().checkpoints) == sorted(names)


def _race(directory: _remote.RemoteDirectory) -> list[str]:
    """12 threads add one entry each to the directory's state file at once; return the names."""
    names = [f"m-{i}" for i in range(12)]

    def add(name: str) -> None:
        def change(state):
            state = state or CheckpointState()
            state.checkpoints.append(CheckpointEntry(name, time.time()))
            return state, None
        directory.update_state(change)

    threads = [threading.Thread(target=add, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return names


class _FakeGCS:
    """The few calls of gcsfs's GCSFileSystem the state file's compare-and-swap makes, with GCS's
    generation semantics as documented (no GCS server here to test against): a media GET answers
    ``x-goog-generation``; an upload with ``ifGenerationMatch`` other than the object's current
    generation (0: none yet) gets 412, which gcsfs raises as FileExistsError."""

    _location = "https://storage.googleapis.com"

    def __init__(self) -> None:
        from fsspec.asyn import get_loop

        self.loop, self.objects, self.calls = get_loop(), {}, []  # key -> (generation, bytes)

    def _strip_protocol(self, url):
        return url.split("://", 1)[1]

    def split_path(self, path):
        bucket, _, key = path.partition("/")
        return bucket, key, None

    def url(self, path):
        return "media:" + path.partition("/")[2]

    def invalidate_cache(self, path=None):
        pass

    async def _call(self, method, path, headers=None, data=None, json_out=False, **params):
        self.calls.append((method, params.get("ifGenerationMatch")))
        if method == "GET":
            key = path[len("media:"):]
            if key not in self.objects:
                raise FileNotFoundError(key)
            generation, raw = self.objects[key]
            return {"x-goog-generation": str(generation)}, raw
        assert params["uploadType"] == "media" and path.endswith("/upload/storage/v1/b/bkt/o")
        current = self.objects.get(params["name"], (0, b""))[0]
        if str(current) != params["ifGenerationMatch"]:
            raise FileExistsError(params["name"])  # 412 Precondition Failed
        self.objects[params["name"]] = (current + 1000, bytes(data))  # generations grow, not by one
        return {}


def test_gcs_state_updates_use_generation_preconditions(monkeypatch):
    fake = _FakeGCS()
    monkeypatch.setattr(_urls, "filesystem", lambda url, options=None: fake)
    directory = _remote.RemoteDirectory("gs://bkt/run")
    assert directory.store.atomic_swap
    names = _race(directory)
    state = parse_state(fake.objects["run/checkpoint"][1], "gs://bkt/run/checkpoint")
    assert sorted(e.path for e in state.checkpoints) == sorted(names)
    posts = [generation for method, generation in fake.calls if method == "POST"]
    assert posts[0] == "0" and all(g is not None for g in posts)  # created only if absent, then matched


# -- commits and orphans ---------------------------------------------------------------------

def test_commit_is_create_only_and_orphans_are_cleaned(s3_bucket):
    directory = _remote.RemoteDirectory(s3_bucket + "/run")

    def write(payload):
        return lambda blob: blob.write_at(payload, 0)

    directory.write_checkpoint("m.bin", write(b"one"))
    data, size, _ = directory.locate("m.bin")
    assert size == 3 and directory.store.read(data, 0, 3) == b"one"
    with pytest.raises(ckpt.CheckpointWriteError, match="m.bin: .*create-only.*nothing was committed"):
        directory.write_checkpoint("m.bin", write(b"two"))
    data2, _, _ = directory.locate("m.bin")
    assert data2 == data and directory.store.read(data, 0, 3) == b"one"
    # the refused writer's data object is gone; a killed save's orphan goes after the grace time
    kept = [e["name"] for e in directory.store.list(directory.join(_remote.DATA_DIR), recursive=True)]
    assert kept == [data.rpartition(_remote.DATA_DIR + "/")[2]]
    orphan = directory.join(f"{_remote.DATA_DIR}/m2.bin/{unique_token()}")
    directory.store.put(orphan, b"partial", create_only=True)
    assert directory.clean_orphans() == []  # still young: might be a save in progress
    assert directory.clean_orphans(grace_s=0.0) == [orphan.rpartition(_remote.DATA_DIR + "/")[2]]
    assert directory.store.read(data, 0, 3) == b"one"  # committed data stays
    directory.delete_checkpoints(["m.bin"])
    assert not directory.exists("m.bin") and not directory.store.exists(data)


# -- faults ------------------------------------------------------------------------------------

def test_missing_bucket_and_object_name_the_url(s3_server):
    store = object_store("s3://no-such-bucket-ckpt")
    with pytest.raises(ckpt.CheckpointNotFoundError, match="s3://no-such-bucket-ckpt/x: .*bucket does not exist"):
        store.read("s3://no-such-bucket-ckpt/x", 0, 4)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="bucket does not exist"):
        store.put("s3://no-such-bucket-ckpt/x", b"1", create_only=True)


def test_connection_refused_is_a_storage_error_naming_the_url():
    pytest.importorskip("s3fs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
    store = object_store("s3://bkt", options)
    with pytest.raises(ckpt.StorageError, match="s3://bkt/m: reading .*cannot be reached"):
        store.read("s3://bkt/m", 0, 4)
    with pytest.raises(ckpt.CheckpointWriteError,
                       match="s3://bkt/m: writing: .*cannot be reached.*nothing was committed"):
        store.put("s3://bkt/m", b"x", create_only=True)


def test_fault_translation_covers_credentials_permissions_and_timeouts():
    url = "s3://b/m"
    assert isinstance(store_error(PermissionError("Access Denied"), url, "reading"), ckpt.StorageError)
    assert "access denied" in str(store_error(PermissionError("Access Denied"), url, "reading"))
    no_creds = type("NoCredentialsError", (Exception,), {})("Unable to locate credentials")
    err = store_error(no_creds, url, "reading")
    assert isinstance(err, ckpt.StorageError) and "AWS_ACCESS_KEY_ID" in str(err) and str(err).startswith(url)
    err = store_error(TimeoutError(), url, "writing", writing=True)
    assert isinstance(err, ckpt.CheckpointWriteError) and "cannot be reached" in str(err)


def test_urls():
    assert _urls.is_url("s3://b/k") and _urls.is_url("memory://x") and not _urls.is_url("file:///tmp/x")
    assert not _urls.is_url("/tmp/x") and not _urls.is_url("C:/x")
    assert _urls.local_path("file:///tmp/x") == "/tmp/x"
    assert _urls.split("s3://b/run/") == ("s3://b", "run")
    assert _urls.split("s3://b") == ("s3://b", "")
    with pytest.raises(ckpt.CheckpointError, match="nope://x: no filesystem"):
        _urls.filesystem("nope://x")


@pytest.mark.parametrize("url, problem", [("s3://", "no bucket"), ("s3:///run", "no bucket"),
                                          ("s3://b//run", "empty part"), ("memory://", "no bucket")])
def test_a_url_without_a_bucket_or_with_an_empty_part_is_an_invalid_url_error(url, problem):
    for call in (lambda: ckpt.latest_checkpoint(url), lambda: ckpt.load_checkpoint(url),
                 lambda: ckpt.list_checkpoints(url), lambda: ckpt.Saver([ckpt.Variable(1.0, name="v")]).restore(url)):
        with pytest.raises(ckpt.InvalidURLError, match=f"^{url}: .*{problem}") as caught:
            call()
        assert isinstance(caught.value, ValueError)


def test_storage_options_that_are_not_a_mapping_are_a_type_error_saying_what_is_expected():
    expected = "storage_options must be a mapping .* got str 'anon=True'"
    with pytest.raises(TypeError, match=expected):
        ckpt.latest_checkpoint("s3://bkt/run", storage_options="anon=True")
    with pytest.raises(TypeError, match=expected):
        ckpt.load_checkpoint("s3://bkt/run/m.msgpack", storage_options="anon=True")
    with pytest.raises(TypeError, match=expected):
        ckpt.Saver([ckpt.Variable(1.0, name="v")], storage_options="anon=True").save("s3://bkt/run/m.msgpack")


@pytest.mark.parametrize("value", [0, -1, "5", True])
def test_a_deadline_option_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises(ValueError, match=f"storage_options 'ckpt_timeout' must be a positive number, got {value!r}"):
        object_store("s3://bkt", {"ckpt_timeout": value})
    assert object_store("s3://bkt", {"ckpt_timeout": 2.5, "ckpt_rate": 1 << 20}).timeout == 2.5


def test_size_options_reach_the_store_and_bad_ones_are_refused():
    store = object_store("s3://bkt", {"ckpt_upload_part": 5 << 16, "ckpt_single_put_max": 0})
    assert store.sizes == Sizes(upload_part=5 << 16, single_put_max=0)
    assert "ckpt_upload_part" not in store.fs.storage_options  # ckpt's own: not the filesystem's
    for key, value in [("ckpt_upload_part", 0), ("ckpt_part", 1.5), ("ckpt_gap", -1), ("ckpt_chunk", True)]:
        with pytest.raises(ValueError, match=f"storage_options '{key}' must be a whole number of bytes"):
            object_store("s3://bkt", {key: value})


@pytest.mark.parametrize(("url", "kind", "atomic"), [("s3://b/x", "S3Store", True), ("s3a://b/x", "S3Store", True),
                                                     ("gs://b/x", "GCSStore", True), ("memory://x", "MemoryStore", True),
                                                     ("http://example.invalid/x", "ObjectStore", False)])
def test_each_url_gets_its_backends_store(url, kind, atomic):
    if kind == "GCSStore":
        pytest.importorskip("gcsfs")
    store = object_store(url)
    assert type(store).__name__ == kind and store.atomic_swap is atomic
