"""Sharded checkpoints at s3:// URLs across real processes: ranks started by mpiexec (the mpich
wheel) save to and restore from moto's S3 server, which runs in this test process on 127.0.0.1
(the ranks find it through AWS_ENDPOINT_URL, inherited from the s3_server fixture)."""

from __future__ import annotations

import pytest
from conftest import assert_bit_exact
from distributed_support import global_tensors

import ckpt
from ckpt.storage import remote as _remote
from ckpt import distributed

pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py, mpich) is not installed")
pytest.importorskip("s3fs")

from test_mpi import BIG, BLOCK, mpirun


def _keys(bucket_url: str, prefix: str) -> list[str]:
    import boto3

    resp = boto3.client("s3").list_objects_v2(Bucket=bucket_url[5:], Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def test_two_processes_save_to_s3_and_one_or_three_restore(s3_bucket, s3_server, tmp_path):
    run = f"{s3_bucket}/run"
    saved = mpirun(2, "save", str(tmp_path / "out"), run, "7", "2:rows:.msgpack")
    assert {r["paths"]["2"] for r in saved} == {f"{run}/n2/model-7.msgpack"}
    # one launch of 3 processes: the first one restores alone, then all three (columns)
    s3_server.traffic.clear()
    restored = mpirun(3, "restore", str(tmp_path / "out"), "1:rows", "3:cols", "--", f"{run}/n2")
    for m in (1, 3):
        for rank, report in enumerate(restored[:m]):
            result, = report["by_m"][str(m)]
            assert result["wrong"] == [] and result["step"] == 42, (m, rank, result)
            assert 0 < result["bytes_read"]  # tensor bytes the rank read: what it needs, plus block edges
            if m == 1:  # rows: the big tensor and checksum-block edges of the two shard files, no more
                assert result["bytes_read"] <= result["big_needed"] * 1.05 + 4 * BLOCK + 64 * 1024, result
    requests = s3_server.traffic.requests
    assert requests and all(r[0] in ("GET", "HEAD") for r in requests)  # a restore writes nothing
    assert all(r[2].startswith("bytes=") for r in requests if r[0] == "GET")  # ranged reads only
    with ckpt.load_checkpoint(f"{run}/n2") as reader:  # and in this plain process
        for key, value in {**global_tensors(), "big": BIG}.items():
            assert_bit_exact(value, reader.get_tensor(key))
        assert reader.verify() == []


@pytest.mark.parametrize("phase", ["report", "before-record"])
def test_a_rank_killed_mid_save_to_s3_commits_nothing(s3_bucket, tmp_path, phase):
    """``report``: rank 1 dies after uploading its shard file; ``before-record``: rank 0 dies after
    uploading the sharded COMMIT, before the commit record. model-1 stays the latest, whole."""
    run = f"{s3_bucket}/run"
    results = mpirun(3, "kill", str(tmp_path / "out"), run, phase, expect_ok=False)
    assert results[0] is not None and results[0]["saved"] == 1
    assert ckpt.latest_checkpoint(run) == f"{run}/model-1.msgpack"
    assert _keys(s3_bucket, "run/model-") == ["run/model-1.msgpack"]
    assert _keys(s3_bucket, "run/.ckpt-data/model-2.msgpack/")  # what the killed save uploaded: named by nothing
    with ckpt.load_checkpoint(run) as reader:
        for key, value in global_tensors().items():
            assert_bit_exact(value, reader.get_tensor(key))
        assert int(reader.get_tensor("step")) == 42
    saver = ckpt.Saver({"v": ckpt.Variable(1.0, name="v")}, comm=distributed.local())
    saver.save(f"{run}/model.msgpack", global_step=3)
    assert _keys(s3_bucket, "run/.ckpt-data/model-2.msgpack/")  # young: it might be a save in progress
    _remote.RemoteDirectory(run).clean_orphans(grace_s=0.0)  # past the grace period they go
    assert _keys(s3_bucket, "run/.ckpt-data/model-2.msgpack/") == []
    assert _keys(s3_bucket, "run/model-") == ["run/model-1.msgpack", "run/model-3.msgpack"]
