"""Incremental checkpoints at s3:// URLs against moto's S3 server: only missing chunks are
uploaded (existence from one LIST, create-only PUTs), every step restores bit-exact, retention's
collection leaves exactly the kept checkpoints' chunks, two savers share one chunk store, and
`ckpt ls` / `ckpt verify DIR` see the chunks."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_bit_exact, every_dtype_tensors

import ckpt
from ckpt.formats.base import open_reader

pytest.importorskip("s3fs")

CHUNK = 8192


def _keys(bucket_url: str, prefix: str) -> list[str]:
    import boto3

    resp = boto3.client("s3").list_objects_v2(Bucket=bucket_url[5:], Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def _chunks(bucket: str, run: str) -> set[str]:
    return {k.rsplit("/", 1)[1] for k in _keys(bucket, f"{run}/.ckpt-chunks/") if len(k.rsplit("/", 1)[1]) == 64}


def _references(url: str) -> set[str]:
    with open_reader(url) as reader:
        return {c.hex() for k in reader.tensors for c in reader.chunks_of(k)}  # type: ignore[attr-defined]


def test_incremental_saves_to_s3_upload_only_what_changed(s3_bucket, s3_server):
    rng = np.random.default_rng(0)
    tensors = dict(every_dtype_tensors())
    variables = {key: ckpt.Variable(value) for key, value in tensors.items()}
    variables["head"] = ckpt.Variable(rng.standard_normal(5000).astype(np.float32))
    variables["frozen"] = ckpt.Variable(rng.standard_normal(40000).astype(np.float32))  # 20 chunks
    saver = ckpt.Saver(variables, max_to_keep=2, incremental=True, chunk_bytes=CHUNK)
    heads = {}
    for step in range(4):
        variables["head"].assign(rng.standard_normal(5000).astype(np.float32))  # 3 chunks, all new
        heads[step] = variables["head"].numpy().copy()
        s3_server.traffic.clear()
        saver.save(f"{s3_bucket}/run/model.msgpack", global_step=step)
        if step:
            stats = saver.last_incremental
            assert stats is not None and stats.chunks_written == 3 and stats.bytes_written == 5000 * 4
            puts = [r for r in s3_server.traffic.requests if r[0] == "PUT" and "/.ckpt-chunks/" in r[1]
                    and not r[1].endswith("/leases")]
            assert len(puts) == 3  # the head's chunks only: the frozen ones were listed, not re-sent
    kept = [f"{s3_bucket}/run/model-{s}.msgpack" for s in (2, 3)]
    assert saver.last_checkpoints == kept
    assert _chunks(s3_bucket, "run") == _references(kept[0]) | _references(kept[1])
    fresh = {key: ckpt.Variable(np.zeros_like(value) if value.dtype.kind != "O" else np.full(value.shape, b"z", object))
             for key, value in tensors.items()}
    fresh.update(head=ckpt.Variable(np.zeros(5000, np.float32)), frozen=ckpt.Variable(np.zeros(40000, np.float32)))
    ckpt.Saver(fresh).restore(kept[0])
    assert_bit_exact(heads[2], fresh["head"].numpy())
    for key, value in tensors.items():
        assert_bit_exact(value, np.asarray(fresh[key].numpy(), dtype=value.dtype))
    from ckpt.cli import main as cli

    listed = CliRunner().invoke(cli, ["ls", "--json", f"{s3_bucket}/run"])
    assert listed.exit_code == 0, listed.output
    doc = json.loads(listed.output)
    rows = {r["path"]: r for r in (doc["checkpoints"] if isinstance(doc, dict) else doc)}
    assert rows["model-3.msgpack"]["shared"] >= 40000 * 4
    verified = CliRunner().invoke(cli, ["verify", f"{s3_bucket}/run"])
    assert verified.exit_code == 0, verified.output


def test_a_damaged_shared_chunk_fails_every_checkpoint_referencing_it_on_s3(s3_bucket):
    import boto3

    v = {"frozen": ckpt.Variable(np.arange(4096, dtype=np.float32)), "head": ckpt.Variable(np.zeros(10, np.int64))}
    saver = ckpt.Saver(v, max_to_keep=None, incremental=True, chunk_bytes=CHUNK)
    for step in range(2):
        v["head"].assign(np.full(10, step))
        saver.save(f"{s3_bucket}/run/model.msgpack", global_step=step)
    [first] = [c for c in _references(f"{s3_bucket}/run/model-0.msgpack")
               if c in _references(f"{s3_bucket}/run/model-1.msgpack")][:1]
    boto3.client("s3").put_object(Bucket=s3_bucket[5:], Key=f"run/.ckpt-chunks/{first}", Body=b"\0" * CHUNK)
    reports = ckpt.verify_directory(f"{s3_bucket}/run")
    assert [r.ok for r in reports] == [False, False]
    assert all(first in " ".join(r.problems) and "'frozen'" in " ".join(r.problems) for r in reports)
    with ckpt.load_checkpoint(f"{s3_bucket}/run/model-1.msgpack") as reader:
        assert list(reader["head"]) == [1] * 10  # the other tensor is unaffected


def test_two_savers_in_one_s3_directory_never_lose_a_kept_chunk(s3_bucket):
    """Two savers with max_to_keep=2 save side by side into one directory (shared frozen chunks,
    each saver's own head): afterwards every kept checkpoint verifies."""
    rng = np.random.default_rng(1)
    frozen = rng.standard_normal(20000).astype(np.float32)
    errors: list[BaseException] = []

    def run(who: int) -> None:
        try:
            v = {"frozen": ckpt.Variable(frozen.copy()), "head": ckpt.Variable(np.zeros(3000, np.float32))}
            saver = ckpt.Saver(v, max_to_keep=2, incremental=True, chunk_bytes=CHUNK)
            for step in range(4):
                v["head"].assign(np.full(3000, 10 * who + step, np.float32))
                saver.save(f"{s3_bucket}/run/m{who}.msgpack", global_step=step)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(who,)) for who in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    reports = ckpt.verify_directory(f"{s3_bucket}/run")
    assert reports and all(r.ok for r in reports), [r.problems for r in reports]
