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


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def throughput(client, bucket: str, total: int, reps: int,
               server: S3Server | None = None) -> tuple[list[tuple[str, float, float]], dict[str, list]]:
    """[(system, save seconds, restore seconds)] for ``total`` bytes in 4 MiB tensors; the systems
    take turns within each repetition (a loaded machine slows them alike), medians reported. With
    ``server``, also {system: [(method, Range, bytes sent)]}: the requests of its last restore."""
    variables = _variables(total // (4 * MiB), 4 * MiB)
    payload = b"".join(v.numpy().tobytes() for v in variables.values())
    saver = ckpt.Saver(variables, max_to_keep=1, format="msgpack")
    step = iter(range(10 ** 6))
    url = f"s3://{bucket}/ckpt"
    sink = io.BytesIO()

    def managed_get() -> None:
        sink.seek(0)
        client.download_fileobj(bucket, "plain/managed", sink)

    systems = {
        "ckpt Saver (msgpack)": (lambda: saver.save(f"{url}/model", global_step=next(step)),
                                 lambda: saver.restore(url)),
        "boto3 put_object / get_object": (
            lambda: client.put_object(Bucket=bucket, Key="plain/put", Body=payload),
            lambda: client.get_object(Bucket=bucket, Key="plain/put")["Body"].read()),
        "boto3 upload_fileobj / download_fileobj": (
            lambda: client.upload_fileobj(io.BytesIO(payload), bucket, "plain/managed"), managed_get),
    }
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in systems}
    requests: dict[str, list] = {}
    for _ in range(reps):
        for name, (save, _restore) in systems.items():
            times[name][0].append(_timed(save))
        for name, (_save, restore) in systems.items():
            if server is not None:
                server.traffic.clear()
            times[name][1].append(_timed(restore))
            if server is not None:
                requests[name] = [(method, rng, sent) for method, _, rng, sent in server.traffic.requests]
    return [(name, statistics.median(saves), statistics.median(restores))
            for name, (saves, restores) in times.items()], requests


def one_tensor(server: S3Server, bucket: str, total: int) -> dict[str, int]:
    """Requests and bytes for load_variable of one 4 MiB tensor (in the middle of a ``total``-byte
    checkpoint), and for list_variables, counted by the server."""
    variables = _variables(total // (4 * MiB), 4 * MiB)
    url = ckpt.Saver(variables, format="msgpack").save(f"s3://{bucket}/big/model.msgpack")
    del variables
    server.traffic.clear()
    ckpt.load_variable(url, f"layer{total // (8 * MiB):04d}/w")  # one in the middle
    requests = list(server.traffic.requests)
    gets = [r for r in requests if r[0] == "GET"]
    out = {"requests": len(requests), "gets": len(gets), "unranged": sum(1 for g in gets if not g[2]),
           "bytes": sum(r[3] for r in requests), "tensor": 4 * MiB,
           "record": sum(g[3] for g in gets if "/.ckpt-data/" not in g[1])}
    server.traffic.clear()
    ckpt.list_variables(url)
    gets = server.traffic.gets()
    out.update(index_gets=len(gets), index_bytes=sum(g[3] for g in gets))
    return out


def save_memory(url: str, model_mib: int) -> int:
    """Peak resident bytes a Saver.save of a ``model_mib`` MiB model to ``url`` adds beyond the
    model itself, in this process (Linux VmHWM, reset before the save)."""
    from .memory import _reset_peak, _status

    saver = ckpt.Saver(_variables(model_mib // 4, 4 * MiB), format="msgpack")
    saver.save(url, global_step=0)  # the first save: imports, connections, worker threads
    base = _status("VmRSS")
    _reset_peak()
    saver.save(url, global_step=1)
    return _status("VmHWM") - base


def _memory_in_child(bucket: str, model_mib: int) -> int:
    """``save_memory`` in a fresh process (the server's memory is not counted)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "benchmarks.s3", "--memory-of", f"s3://{bucket}/memory/model",
                          "--model-mib", str(model_mib)], cwd=root, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def report(model_mib: int = 256, big_mib: int = 1024, reps: int = 3) -> str:
    """The s3 case's markdown: throughput against boto3, then the one-tensor read's requests."""
    import boto3

    server = S3Server()
    server.start()
    lines = []
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket="bench")
        rows, requests = throughput(client, "bench", model_mib * MiB, reps, server)
        lines += [f"## S3 (moto's server on 127.0.0.1): a {model_mib} MiB model, median of {reps}", "",
                  "| system | save s | save MiB/s | restore s | restore MiB/s |", "|---|---:|---:|---:|---:|"]
        for name, save, restore in rows:
            lines.append(f"| {name} | {save:.2f} | {model_mib / save:.0f} | {restore:.2f} | "
                         f"{model_mib / restore:.0f} |")
        best_save = min(r[1] for r in rows[1:])
        best_restore = min(r[2] for r in rows[1:])
        lines += ["", f"ckpt vs the faster boto3 way: save {best_save / rows[0][1]:.2f}x, "
                      f"restore {best_restore / rows[0][2]:.2f}x (target >= 0.8x)", "",
                  "Requests of one restore (method, Range, bytes the server sent):", ""]
        for name, seen in requests.items():
            listed = [f"{m} {r or '(whole)'} {n:,}" for m, r, n in seen]
            if len(listed) > 6:  # a managed transfer's many parts
                listed = [*listed[:2], f"... {len(listed)} requests, {sum(n for _, _, n in seen):,} bytes"]
            lines.append(f"- {name}: " + ", ".join(listed))
        lines.append("")
        peak = _memory_in_child("bench", model_mib)
        lines += [f"Peak memory of one Saver.save of the {model_mib} MiB model beyond the model itself: "
                  f"{peak / MiB:.0f} MiB (a fresh process; VmHWM)", ""]
        counts = one_tensor(server, "bench", big_mib * MiB)
        extra = counts["bytes"] - counts["tensor"] - counts["record"]
        lines += [f"## S3: one 4 MiB tensor of a {big_mib} MiB checkpoint", "",
                  f"- load_variable: {counts['requests']} requests ({counts['gets']} GETs, {counts['unranged']} "
                  f"without a Range), {counts['bytes']:,} bytes sent: the commit record with the index "
                  f"({counts['record']:,}) + the tensor ({counts['tensor']:,}) + {extra:,} other",
                  f"- list_variables: {counts['index_gets']} GETs, {counts['index_bytes']:,} bytes", ""]
    finally:
        server.stop()
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.s3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-mib", type=int, default=256, help="save/restore model size")
    parser.add_argument("--big-mib", type=int, default=1024, help="checkpoint size for the one-tensor read")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (median reported)")
    parser.add_argument("--memory-of", default="", help=argparse.SUPPRESS)  # the child of _memory_in_child
    args = parser.parse_args()
    if args.memory_of:
        print(save_memory(args.memory_of, args.model_mib))
        return
    print(report(args.model_mib, args.big_mib, args.reps))


if __name__ == "__main__":
    main()
