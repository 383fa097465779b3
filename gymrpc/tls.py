"""TLS and mTLS material: which files a server or client uses, and a private CA for one stack.

A stack speaks TLS when its servers get a certificate and key; with a CA as well, servers
also demand a client certificate signed by it (mTLS) and verify the servers they call with
it. `gymrpc up --tls` creates that CA and a certificate per server in `<run dir>/tls` (every
file mode 0600) and writes `tls.json`, from which `gymrpc.Client`, `gymrpc call`/`ctl` and the
Node client learn to speak TLS with the client certificate. The CA's key is used once and
never written: nobody can issue another certificate of the stack afterwards.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

TLS_DIR = "tls"
TLS_FILE = "tls.json"
"""Run-folder file naming the CA and the client certificate of a TLS stack (`TlsFiles` as JSON)."""
LOOPBACK_NAMES = ("localhost",)
CERT_DAYS = 365


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one side of a connection.

    A server needs `cert` and `key`; with `ca` it requires client certificates signed by it.
    A client needs `ca` to verify servers, and `cert`/`key` to present (mTLS).
    `server_name` is the name to check in server certificates instead of the target's host.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS needs a certificate and its key together (got only one)")

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> TlsFiles:
        unknown = set(data) - {"cert", "key", "ca", "server_name"}
        if unknown:
            raise ValueError(f"tls: unknown keys {sorted(unknown)} (expected cert, key, ca, server_name)")
        return cls(**{k: str(v) for k, v in data.items() if v is not None})

    def _read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return read(self.ca), read(self.key), read(self.cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        ca, key, cert = self._read()
        if key is None or cert is None:
            raise ValueError("a TLS server needs a certificate and a key")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca, key, cert = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self, target: str = "") -> list[tuple[str, Any]]:
        """A unix socket has no host name: its server's certificate is checked for `localhost`."""
        name = self.server_name or ("localhost" if target.startswith(("unix:", "unix-abstract:")) else None)
        return [("grpc.ssl_target_name_override", name)] if name else []


def read_run_dir_tls(run_dir: Path) -> TlsFiles | None:
    """The client side of the run folder's stack: None when it speaks plaintext."""
    path = run_dir / TLS_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    files = TlsFiles.of(data)
    return TlsFiles(**{k: _resolve(run_dir, v) if k != "server_name" else v for k, v in asdict(files).items()})


def _resolve(run_dir: Path, value: str | None) -> str | None:
    return None if value is None else str(run_dir / value)  # an absolute value stays as it is


def write_run_dir_tls(run_dir: Path, files: TlsFiles) -> None:
    write_private(run_dir / TLS_FILE, json.dumps({k: v for k, v in asdict(files).items() if v is not None}).encode())


def write_private(path: Path, data: bytes) -> None:
    """Write a file readable by its owner only (also when it already existed with wider rights)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def local_hosts() -> list[str]:
    """Names and addresses this machine is reached by: loopback, its hostname, its IPv4 addresses."""
    hosts = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None):
            hosts.append(str(info[4][0]))
    except OSError:
        pass
    try:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: only picks the outgoing interface
            hosts.append(probe.getsockname()[0])
        finally:
            probe.close()
    except OSError:
        pass
    return list(dict.fromkeys(hosts))


@dataclass(frozen=True)
class StackPki:
    """What `create_stack_pki` wrote: the files of each server (by label) and of clients."""

    servers: dict[str, TlsFiles]
    client: TlsFiles
    ca: str


def create_stack_pki(folder: Path, labels: Iterable[str], hosts: Iterable[str]) -> StackPki:
    """A private CA, one certificate per server label and one for clients, under `folder`.

    Every server certificate names `hosts` (DNS names and IP addresses) and serves as that
    server's client certificate too (servers call each other and the registry).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gymrpc stack CA {os.urandom(4).hex()}")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    ca_path = folder / "ca.crt"
    write_private(ca_path, ca_cert.public_bytes(pem))
    alt_names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))

    def issue(label: str, file_stem: str) -> TlsFiles:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        write_private(folder / f"{file_stem}.crt", cert.public_bytes(pem))
        key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        write_private(folder / f"{file_stem}.key", key_pem)
        return TlsFiles(cert=str(folder / f"{file_stem}.crt"), key=str(folder / f"{file_stem}.key"), ca=str(ca_path))

    servers = {label: issue(label, "server-" + label.replace("/", "__")) for label in dict.fromkeys(labels)}
    return StackPki(servers=servers, client=issue("gymrpc client", "client"), ca=str(ca_path))


def is_loopback_bind(bind: str) -> bool:
    """True for unix sockets and loopback hosts: the only binds plaintext is allowed on."""
    if bind.startswith(("unix:", "unix-abstract:")):
        return True
    host = bind.rpartition(":")[0].strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
