"""Certificates and NKeys made at test time: a private CA, server and client certificates signed
by it, and NATS NKey user seeds, written as PEM / seed files into a directory of the test's own.

``make_pki(directory)`` answers a ``Pki`` with the CA, one server certificate valid for
``127.0.0.1`` and ``localhost`` (every test server and the HTTPS API use it) and ``client(name)``
to issue client certificates for mutual TLS, each naming ``name`` in a DNS SAN (the NATS user it
is bound to). ``make_nkey_user(directory, name)`` writes a user
NKey seed file and answers its public key, the way ``nk -gen user`` would.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = datetime.timedelta(days=2)


@dataclass(frozen=True)
class CertFiles:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path


def _write_private(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass
class Pki:
    """A test CA in ``directory`` and what it has signed."""

    directory: Path
    ca: Path
    server: CertFiles
    _ca_key: ec.EllipticCurvePrivateKey
    _ca_cert: x509.Certificate
    clients: dict[str, CertFiles] = field(default_factory=dict)

    def client(self, name: str) -> CertFiles:
        """A client certificate for mutual TLS naming ``name`` (common name and DNS SAN: the NATS
        user a server with ``verify_and_map`` takes it for), made once per name."""
        if name not in self.clients:
            self.clients[name] = _issue(
                self.directory, name, self._ca_key, self._ca_cert, server=False
            )
        return self.clients[name]


def _issue(
    directory: Path,
    name: str,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    *,
    server: bool,
) -> CertFiles:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                if server
                else [ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    )
    if server:
        names: list[x509.GeneralName] = [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
    else:
        # The identity nats-server's verify_and_map takes the user from: a DNS SAN equal to it.
        names = [x509.DNSName(name)]
    builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_path = directory / f"{name}.crt"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = _write_private(directory / f"{name}.key", _key_pem(key))
    return CertFiles(cert_path, key_path)


def make_pki(directory: Path) -> Pki:
    """A fresh CA and a server certificate for 127.0.0.1 / localhost, written to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "apomesh test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
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
    ca_path = directory / "ca.crt"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    server = _issue(directory, "server", ca_key, ca_cert, server=True)
    return Pki(directory, ca_path, server, ca_key, ca_cert)


# --------------------------------------------------------------------------------------------
# NKeys: base32 of (prefix bytes + key + crc16), as the nkeys libraries encode them.

_PREFIX_SEED = 18 << 3
_PREFIX_USER = 20 << 3


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc


def _encode(raw: bytes) -> bytes:
    return base64.b32encode(raw + _crc16(raw).to_bytes(2, "little")).rstrip(b"=")


def make_nkey_user(directory: Path, name: str) -> tuple[Path, str]:
    """A new user NKey: writes its seed to ``<directory>/<name>.nk`` (mode 0600) and answers
    (seed file, public key ``U...``)."""
    private = ed25519.Ed25519PrivateKey.generate()
    raw_seed = private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    raw_public = private.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    seed_prefix = bytes([_PREFIX_SEED | (_PREFIX_USER >> 5), (_PREFIX_USER & 31) << 3])
    seed = _encode(seed_prefix + raw_seed)
    public = _encode(bytes([_PREFIX_USER]) + raw_public).decode()
    directory.mkdir(parents=True, exist_ok=True)
    path = _write_private(directory / f"{name}.nk", seed + b"\n")
    return path, public
