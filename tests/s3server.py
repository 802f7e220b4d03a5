"""moto's S3 server on 127.0.0.1 for the object-store tests, with a request counter.

The server is real HTTP on a free loopback port (``port=0``): every test talks to it through
s3fs/botocore exactly as it would to S3. ``Traffic`` counts what reaches it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterable

#: The smallest part moto accepts in a multipart upload (S3: 5 MiB). The upload tests run the same
#: code on 1/16 of the bytes (``ckpt_upload_part`` of 320 KiB), so the server's minimum follows;
#: set before moto is imported, which reads it once.
MIN_PART = 5 << 16
os.environ.setdefault("S3_UPLOAD_PART_MIN_SIZE", str(MIN_PART))

#: The credentials and region the fixtures put in the environment (moto accepts any).
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_SESSION_TOKEN": "testing"}


@dataclass
class Traffic:
    """Requests seen by the server: (method, path, Range header, response body bytes)."""

    requests: list[tuple[str, str, str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()

    def gets(self) -> list[tuple[str, str, str, int]]:
        with self.lock:
            return [r for r in self.requests if r[0] == "GET"]

    @property
    def bytes_sent(self) -> int:
        with self.lock:
            return sum(r[3] for r in self.requests)


class _Counting:
    """WSGI middleware recording each request and the bytes of its response body."""

    def __init__(self, app: Callable[..., Iterable[bytes]], traffic: Traffic) -> None:
        self.app, self.traffic = app, traffic

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = self.app(environ, start_response)
        chunks = list(body)
        if hasattr(body, "close"):
            body.close()
        with self.traffic.lock:
            self.traffic.requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""),
                                          environ.get("HTTP_RANGE", ""), sum(len(c) for c in chunks)))
        return chunks


def self_signed(directory: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, written as PEM files in ``directory`` (cryptography
    comes with moto): (certificate path, key path). Clients trust it through AWS_CA_BUNDLE or
    botocore's ``verify``."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


def _tls_moto_server(cert: tuple[str, str]) -> Any:
    """moto's ThreadedMotoServer serving https with ``cert`` (it has no TLS option of its own)."""
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, ThreadedMotoServer, create_backend_app
    from werkzeug.serving import make_server

    class TlsMotoServer(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = DomainDispatcherApplication(create_backend_app)
            self._server = make_server(self._ip_address, self._port, app, True,
                                       request_handler=MotoRequestHandler, ssl_context=cert)
            self._server_ready_event.set()
            self._server.serve_forever()

    return TlsMotoServer(ip_address="127.0.0.1", port=0, verbose=False)


class S3Server:
    """Start moto's ThreadedMotoServer on 127.0.0.1 (a free port) and point botocore at it; with
    ``cert`` (a certificate and key path, see ``self_signed``) it serves https, and the environment
    sets nothing (a test passes the endpoint and CA through storage_options)."""

    def __init__(self, cert: tuple[str, str] | None = None) -> None:
        from moto.server import ThreadedMotoServer

        self._tls = cert is not None
        self._server = (_tls_moto_server(cert) if cert is not None
                        else ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False))
        self.traffic = Traffic()
        self._saved_env: dict[str, str | None] = {}

    def start(self) -> str:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self._server.start()
        wsgi = self._server._server  # the werkzeug server: count what its app answers
        wsgi.app = _Counting(wsgi.app, self.traffic)
        host, port = self._server.get_host_and_port()
        self.endpoint = f"{'https' if self._tls else 'http'}://{host}:{port}"
        if self._tls:
            return self.endpoint
        for name, value in {**ENV, "AWS_ENDPOINT_URL": self.endpoint}.items():
            self._saved_env[name] = os.environ.get(name)
            os.environ[name] = value
        return self.endpoint

    def stop(self) -> None:
        self._server.stop()
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
