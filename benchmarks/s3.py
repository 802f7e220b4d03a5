"""python -m benchmarks.s3: ckpt against plain boto3 on moto's S3 server (127.0.0.1, a free port).

* save and restore of a model (default 256 MiB: 64 float32 tensors of 4 MiB, msgpack) through
  ckpt's Saver, against boto3 moving the same bytes: one put_object/get_object, and boto3's
  managed transfer (upload_fileobj/download_fileobj: parallel multipart parts);
* requests and bytes the server sends for reading one 4 MiB tensor of a larger checkpoint
  (default 1 GiB), and for list_variables, counted by the server itself.

Needs the test extra (moto[server], s3fs). Both sides talk HTTP to the same in-process server,
so the figures compare clients on equal terms; moto (pure Python) is slower than S3 itself.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time

import numpy as np

import ckpt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from s3server import S3Server

MiB = 1 << 20


def _variables(count: int, nbytes: int) -> dict[str, ckpt.Variable]:
    rng = np.random.default_rng(0)
    return {f"layer{i:04d}/w": ckpt.Variable(rng.standard_normal(nbytes // 4, dtype=np.float32))
            for i in range(count)}


def _median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def throughput(server: S3Server, client, bucket: str, total: int, reps: int) -> list[tuple[str, float, float]]:
    """[(system, save seconds, restore seconds)] for ``total`` bytes in 4 MiB tensors."""
    variables = _variables(total // (4 * MiB), 4 * MiB)
    payload = b"".join(v.numpy().tobytes() for v in variables.values())
    saver = ckpt.Saver(variables, max_to_keep=1, format="msgpack")
    step = iter(range(10 ** 6))
    url = f"s3://{bucket}/ckpt"
    ckpt_save = _median(lambda: saver.save(f"{url}/model", global_step=next(step)), reps)
    ckpt_restore = _median(lambda: saver.restore(url), reps)
    put = _median(lambda: client.put_object(Bucket=bucket, Key="plain/put", Body=payload), reps)
    get = _median(lambda: client.get_object(Bucket=bucket, Key="plain/put")["Body"].read(), reps)
    managed_put = _median(lambda: client.upload_fileobj(io.BytesIO(payload), bucket, "plain/managed"), reps)
    sink = io.BytesIO()

    def managed_get() -> None:
        sink.seek(0)
        client.download_fileobj(bucket, "plain/managed", sink)

    managed_restore = _median(managed_get, reps)
    return [("ckpt Saver (msgpack)", ckpt_save, ckpt_restore), ("boto3 put_object / get_object", put, get),
            ("boto3 upload_fileobj / download_fileobj", managed_put, managed_restore)]


def one_tensor(server: S3Server, bucket: str, total: int) -> dict[str, int]:
    """Requests and bytes for load_variable of one 4 MiB tensor, and for list_variables."""
    variables = _variables(total // (4 * MiB), 4 * MiB)
    url = ckpt.Saver(variables, format="msgpack").save(f"s3://{bucket}/big/model.msgpack")
    del variables
    server.traffic.clear()
    ckpt.load_variable(url, f"layer{total // (8 * MiB):04d}/w")  # one in the middle
    gets = server.traffic.gets()
    out = {"tensor_gets": len(gets), "tensor_bytes": sum(g[3] for g in gets),
           "tensor_unranged": sum(1 for g in gets if not g[2]),
           "requests": len(server.traffic.requests)}
    server.traffic.clear()
    ckpt.list_variables(url)
    gets = server.traffic.gets()
    out.update(index_gets=len(gets), index_bytes=sum(g[3] for g in gets), size=total)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.s3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-mib", type=int, default=256, help="save/restore model size")
    parser.add_argument("--big-mib", type=int, default=1024, help="checkpoint size for the one-tensor read")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (median reported)")
    args = parser.parse_args()
    import boto3

    server = S3Server()
    server.start()
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket="bench")
        rows = throughput(server, client, "bench", args.model_mib * MiB, args.reps)
        size = args.model_mib * MiB
        print(f"## {args.model_mib} MiB model, moto S3 server on 127.0.0.1, median of {args.reps}\n")
        print("| system | save s | save MiB/s | restore s | restore MiB/s |")
        print("|---|---:|---:|---:|---:|")
        for name, save, restore in rows:
            print(f"| {name} | {save:.2f} | {size / MiB / save:.0f} | {restore:.2f} | {size / MiB / restore:.0f} |")
        best_save = min(r[1] for r in rows[1:])
        best_restore = min(r[2] for r in rows[1:])
        print(f"\nckpt vs the faster boto3 way: save {best_save / rows[0][1]:.2f}x, "
              f"restore {best_restore / rows[0][2]:.2f}x (target >= 0.8x)\n")
        counts = one_tensor(server, "bench", args.big_mib * MiB)
        print(f"## one 4 MiB tensor of a {args.big_mib} MiB checkpoint\n")
        print(f"- load_variable: {counts['tensor_gets']} GETs ({counts['tensor_unranged']} without a Range), "
              f"{counts['tensor_bytes']:,} bytes sent ({counts['tensor_bytes'] - 4 * MiB:,} besides the tensor), "
              f"{counts['requests']} requests in all")
        print(f"- list_variables: {counts['index_gets']} GETs, {counts['index_bytes']:,} bytes")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
