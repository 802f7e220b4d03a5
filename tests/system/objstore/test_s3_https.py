"""Saves and restores over https: moto's S3 server behind TLS on 127.0.0.1 (a self-signed
certificate made by the fixture), the endpoint and CA given through storage_options.

Over https botocore sends a streamed body differently from http (its own CRC trailer in
aws-chunked encoding rather than a header), so both upload modes — one PUT of lent buffers and a
multipart upload — are checked end to end here, with the bytes compared to a local save.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from conftest import assert_bit_exact, every_dtype_tensors

import ckpt

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

MiB = 1 << 20


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """moto's S3 server serving https on 127.0.0.1 (free port): (server, storage_options)."""
    from s3server import S3Server, self_signed

    cert = self_signed(str(tmp_path_factory.mktemp("tls")))
    server = S3Server(cert)
    endpoint = server.start()
    wsgi = server._server._server
    app, server.payloads = wsgi.app, []

    def noting_payloads(environ, start_response):  # how botocore sent each data PUT's body
        if environ["REQUEST_METHOD"] == "PUT" and "/.ckpt-data/" in environ.get("PATH_INFO", ""):
            server.payloads.append(environ.get("HTTP_X_AMZ_CONTENT_SHA256", ""))
        return app(environ, start_response)

    wsgi.app = noting_payloads
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "client_kwargs": {"verify": cert[0], "region_name": "us-east-1"}}
    yield server, options
    server.stop()


@pytest.fixture
def tls_bucket(tls_server):
    """A fresh bucket on the https server: (its URL, storage_options, traffic)."""
    import uuid

    import boto3

    server, options = tls_server
    name = f"ckpt-tls-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=options["endpoint_url"], verify=options["client_kwargs"]["verify"],
                 aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=name)
    server.traffic.clear()
    server.payloads.clear()
    return f"s3://{name}", options, server


@pytest.mark.parametrize("multipart", [False, True], ids=["one PUT", "multipart"])
@pytest.mark.parametrize("fmt", ["msgpack", "hdf5"])
def test_round_trip_over_https_matches_a_local_save(fmt, multipart, tls_bucket, tmp_path, monkeypatch):
    url, options, server = tls_bucket
    traffic = server.traffic
    if multipart:  # 5 MiB parts (S3's smallest) and no object small enough for one PUT
        options = {**options, "ckpt_single_put_max": 0, "ckpt_upload_part": 5 * MiB}
    rng = np.random.default_rng(7)
    tensors = dict(every_dtype_tensors())
    tensors["big"] = rng.standard_normal((3 * MiB,)).astype(np.float32)  # 12 MiB: three parts
    variables = {key: ckpt.Variable(value) for key, value in tensors.items()}
    saver = ckpt.Saver(variables, format=fmt, storage_options=options)
    remote = saver.save(f"{url}/run/model", global_step=1)
    puts = [r for r in traffic.requests if r[0] == "PUT" and "/.ckpt-data/" in r[1]]
    posts = [r for r in traffic.requests if r[0] == "POST" and "/.ckpt-data/" in r[1]]
    assert (len(puts), len(posts)) == ((3, 2) if multipart else (1, 0)), traffic.requests
    # over https botocore streams the body in aws-chunked encoding with its CRC in a trailer
    assert server.payloads == ["STREAMING-UNSIGNED-PAYLOAD-TRAILER"] * len(puts)

    local = ckpt.Saver(variables, format=fmt).save(str(tmp_path / "model"), global_step=1)
    with open(local, "rb") as f:
        expected = hashlib.sha256(f.read()).hexdigest()
    import fsspec

    fs = fsspec.filesystem("s3", **{k: v for k, v in options.items() if not k.startswith("ckpt_")})
    data = [path for path in fs.find(url[5:]) if "/.ckpt-data/" in path]
    assert [hashlib.sha256(fs.cat_file(path)).hexdigest() for path in data] == [expected]

    fresh = {key: ckpt.Variable(np.zeros_like(value) if value.dtype.kind != "O" else np.full(value.shape, b"z", object))
             for key, value in tensors.items()}
    assert ckpt.Saver(fresh, storage_options=options).restore(remote).path == remote
    for key, value in tensors.items():
        assert_bit_exact(value, np.asarray(fresh[key].numpy(), dtype=value.dtype))
