"""Sharded checkpoints (``Saver(comm=)``) at s3:// URLs against moto's S3 server on 127.0.0.1:
N -> M resharding restores, retention deleting every object, a rank failing mid-upload, the CLI."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_bit_exact
from distributed_support import global_tensors, layout, make_variables, run_ranks

import ckpt
from ckpt.storage import remote as _remote, s3upload as _uploads
from ckpt import distributed

pytest.importorskip("s3fs")


def _keys(bucket_url: str, prefix: str = "") -> list[str]:
    import boto3

    resp = boto3.client("s3").list_objects_v2(Bucket=bucket_url[5:], Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def _save(url: str, size: int, kind: str, step: int, **saver_args: object) -> list:
    tensors = global_tensors()

    def fn(comm: distributed.Communicator) -> str:
        variables = make_variables(tensors, kind, comm.rank, size)
        return ckpt.Saver(variables, comm=comm, timeout=30, **saver_args).save(f"{url}/model.msgpack",
                                                                               global_step=step)

    return run_ranks(size, fn)


def _restore(url: str, size: int, kind: str) -> list:
    tensors = global_tensors()

    def fn(comm: distributed.Communicator) -> tuple[str, dict]:
        variables = make_variables(tensors, kind, comm.rank, size, zero=True)
        result = ckpt.Saver(variables, comm=comm, timeout=30).restore(url)
        return result.path, {k: v.numpy() for k, v in variables.items()}

    return run_ranks(size, fn)


def _check(got: list, kind: str, size: int, path: str) -> None:
    tensors = global_tensors()
    for rank, item in enumerate(got):
        assert not isinstance(item, BaseException), item
        restored_from, values = item
        assert restored_from == path
        for key, value in tensors.items():
            offset, block = layout(kind, value.shape, rank, size)
            assert_bit_exact(np.asarray(value[tuple(slice(o, o + b) for o, b in zip(offset, block))]),
                             np.asarray(values[key]).reshape(block))


@pytest.mark.parametrize("n,m,kind_in,kind_out", [(2, 3, "rows", "cols"), (3, 2, "uneven", "rows")])
def test_sharded_save_to_s3_restores_on_other_rank_counts(s3_bucket, n, m, kind_in, kind_out):
    run = f"{s3_bucket}/run"
    paths = _save(run, n, kind_in, step=5)
    assert paths == [f"{run}/model-5.msgpack"] * n
    assert ckpt.latest_checkpoint(run) == paths[0]
    # the shard files and their COMMIT sit under one unique data prefix; the name is the commit record
    keys = _keys(s3_bucket, "run/")
    data = [k for k in keys if k.startswith("run/.ckpt-data/model-5.msgpack/")]
    assert len({k.rsplit("/", 1)[0] for k in data}) == 1
    assert sorted(k.rsplit("/", 1)[1].partition(".")[2] for k in data) == \
        [""] + [f"{rank:05d}-of-{n:05d}.msgpack" for rank in range(n)]  # COMMIT and one file per rank
    assert [k for k in keys if not k.startswith("run/.ckpt-data/")] == ["run/checkpoint", "run/model-5.msgpack"]
    _check(_restore(run, m, kind_out), kind_out, m, paths[0])
    with ckpt.load_checkpoint(paths[0]) as reader:  # one plain process: global tensors, partial reads
        assert reader.format == "ckpt-sharded" and reader.verify() == []
        for key, value in global_tensors().items():
            assert_bit_exact(value, reader.get_tensor(key))
        emb = global_tensors()["emb"]
        assert_bit_exact(emb[3:9], reader.get_slice("emb", np.s_[3:9]))


def test_retention_deletes_every_object_of_a_dropped_sharded_checkpoint(s3_bucket):
    run = f"{s3_bucket}/run"
    for step in (1, 2, 3):
        assert all(isinstance(p, str) for p in _save(run, 2, "rows", step=step, max_to_keep=2))
    keys = _keys(s3_bucket, "run/")
    assert [k for k in keys if not k.startswith("run/.ckpt-data/")] == \
        ["run/checkpoint", "run/model-2.msgpack", "run/model-3.msgpack"]
    assert not [k for k in keys if "model-1.msgpack" in k]  # its commit record, shard files and COMMIT
    assert sorted({k.split("/")[2] for k in keys if k.startswith("run/.ckpt-data/")}) == \
        ["model-2.msgpack", "model-3.msgpack"]


def test_a_rank_failing_mid_upload_commits_nothing(s3_bucket, monkeypatch):
    run = f"{s3_bucket}/run"
    _save(run, 2, "rows", step=1)
    before = _keys(s3_bucket)
    finish = _uploads.S3Upload.finish

    def failing(self):  # the shard file's upload fails as it completes
        if "00001-of-00003" in self.url:
            self.abort()
            raise ckpt.CheckpointWriteError(f"{self.url}: connection reset (injected)")
        return finish(self)

    monkeypatch.setattr(_uploads.S3Upload, "finish", failing)
    results = _save(run, 3, "rows", step=2)
    for result in results:
        assert isinstance(result, ckpt.CheckpointWriteError), result
        assert "nothing was committed" in str(result) and "connection reset" in str(result)
    monkeypatch.undo()
    assert _keys(s3_bucket) == before  # the other ranks' uploads were deleted again
    assert ckpt.latest_checkpoint(run) == f"{run}/model-1.msgpack"
    _check(_restore(run, 3, "cols"), "cols", 3, f"{run}/model-1.msgpack")


def test_saving_a_committed_name_again_is_refused_on_every_rank(s3_bucket):
    run = f"{s3_bucket}/run"
    _save(run, 2, "rows", step=1)
    before = _keys(s3_bucket)
    for result in _save(run, 2, "rows", step=1):
        assert isinstance(result, ckpt.CheckpointWriteError) and "exists" in str(result), result
    assert _keys(s3_bucket) == before


def test_cli_on_a_sharded_checkpoint_in_s3(s3_bucket):
    from ckpt.cli import main

    run = f"{s3_bucket}/run"
    path = _save(run, 3, "uneven", step=9)[0]
    runner = CliRunner()
    result = runner.invoke(main, ["inspect", path], catch_exceptions=False)
    assert result.exit_code == 0 and "tensor: emb (float32) [37, 5]" in result.output, result.output
    result = runner.invoke(main, ["inspect", run], catch_exceptions=False)
    assert result.exit_code == 0 and "emb" in result.output
    assert runner.invoke(main, ["verify", path], catch_exceptions=False).exit_code == 0
    listing = runner.invoke(main, ["ls", run], catch_exceptions=False)
    assert listing.exit_code == 0 and "model-9.msgpack" in listing.output and "latest" in listing.output


def test_orphaned_shard_files_of_killed_saves_are_cleaned(s3_bucket):
    import time

    import boto3

    run = f"{s3_bucket}/run"
    _save(run, 2, "rows", step=1)
    committed = _keys(s3_bucket, "run/.ckpt-data/")
    client = boto3.client("s3")
    old = "run/.ckpt-data/model-7.msgpack/000000000001-00000000000000aa/00000000000000aa.00000-of-00002.msgpack"
    young = (f"run/.ckpt-data/model-8.msgpack/{int(time.time() * 1000):012x}-00000000000000bb/"
             "00000000000000bb.00000-of-00002.msgpack")
    for key in (old, young):  # a save killed after its upload: no commit record names its prefix
        client.put_object(Bucket=s3_bucket[5:], Key=key, Body=b"partial")
    _save(run, 2, "rows", step=2)
    keys = _keys(s3_bucket, "run/.ckpt-data/")
    assert old not in keys and young in keys  # a young prefix may belong to a live save
    assert set(committed) <= set(keys)  # the committed checkpoint's objects are kept
    _check(_restore(f"{run}/model-1.msgpack", 2, "cols"), "cols", 2, f"{run}/model-1.msgpack")


def test_asynchronous_sharded_save_to_s3_and_listed_size(s3_bucket):
    tensors = global_tensors()
    run = f"{s3_bucket}/run"

    def fn(comm: distributed.Communicator) -> str:
        variables = make_variables(tensors, "rows", comm.rank, 2)
        future = ckpt.Saver(variables, comm=comm, timeout=30).save(f"{run}/model.msgpack", global_step=4,
                                                                   blocking=False)
        return future.result()

    assert run_ranks(2, fn) == [f"{run}/model-4.msgpack"] * 2
    _check(_restore(run, 3, "uneven"), "uneven", 3, f"{run}/model-4.msgpack")
    import boto3

    objects = boto3.client("s3").list_objects_v2(Bucket=s3_bucket[5:], Prefix="run/.ckpt-data/")["Contents"]
    [listed] = ckpt.list_checkpoints(run)
    assert listed.latest and listed.size == sum(o["Size"] for o in objects)  # shard files and COMMIT


def test_storage_options_reach_every_rank_and_every_shard_file(s3_bucket, monkeypatch):
    import os

    tensors = global_tensors()
    run = f"{s3_bucket}/run"
    options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # without the options, nothing reaches the test server

    def save(comm: distributed.Communicator) -> str:
        variables = make_variables(tensors, "rows", comm.rank, 2)
        return ckpt.Saver(variables, comm=comm, timeout=30, storage_options=options).save(
            f"{run}/model.msgpack", global_step=2)

    def restore(comm: distributed.Communicator) -> tuple[str, dict]:
        variables = make_variables(tensors, "cols", comm.rank, 3, zero=True)
        result = ckpt.Saver(variables, comm=comm, timeout=30, storage_options=options).restore(run)
        return result.path, {k: v.numpy() for k, v in variables.items()}

    assert run_ranks(2, save) == [f"{run}/model-2.msgpack"] * 2
    _check(run_ranks(3, restore), "cols", 3, f"{run}/model-2.msgpack")
    with ckpt.load_checkpoint(run, storage_options=options) as reader:  # shard files opened after open
        assert_bit_exact(tensors["emb"], reader.get_tensor("emb"))


@pytest.mark.parametrize("change", [b"", b"x" * 100])
def test_a_shard_file_truncated_or_replaced_in_the_store_is_corrupt(s3_bucket, s3_server, change):
    """Shard files open with the size the record lists: head and tail in one round trip (two
    ranged GETs side by side, no commit-record probe), and a store answering with another size
    is a CorruptCheckpointError naming the file."""
    import boto3

    run = f"{s3_bucket}/run"
    path = _save(run, 2, "rows", step=1)[0]
    s3_server.traffic.clear()
    with ckpt.load_checkpoint(path) as reader:
        reader.get_slice("emb", np.s_[0:1])  # opens the first shard file
        first = [g for g in s3_server.traffic.gets() if g[1].endswith("00000-of-00002.msgpack")]
    assert len(first) <= 3 and sum(g[3] for g in first) < 2 * (_remote.OPEN_HEAD + _remote.OPEN_TAIL)
    client = boto3.client("s3")
    key = next(k for k in _keys(s3_bucket, "run/.ckpt-data/") if k.endswith("00000-of-00002.msgpack"))
    body = client.get_object(Bucket=s3_bucket[5:], Key=key)["Body"].read()
    client.put_object(Bucket=s3_bucket[5:], Key=key, Body=body[:-100] if not change else body + change)
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"{key}.*(truncated|replaced)"):
        with ckpt.load_checkpoint(path) as reader:
            reader.get_tensor("emb")
