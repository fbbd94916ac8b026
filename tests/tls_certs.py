"""Throw-away certificates for TLS tests: a CA, a server/worker cert for 127.0.0.1, and a rogue CA."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, cert, key) -> tuple[str, str]:
    cert_path, key_path = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


def _cert(subject: str, key, issuer_name, issuer_key, *, ca: bool):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(folder: Path) -> dict[str, str]:
    """Files: ca, node cert/key (signed by ca), rogue_ca, rogue cert/key (signed by rogue_ca)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for prefix in ("", "rogue_"):
        ca_key = _key()
        ca = _cert(f"{prefix}vlkv test CA", ca_key, _name(f"{prefix}vlkv test CA"), ca_key, ca=True)
        out[f"{prefix}ca"], _ = _write(folder / f"{prefix}ca", ca, ca_key)
        node_key = _key()
        node = _cert(f"{prefix}node", node_key, ca.subject, ca_key, ca=False)
        out[f"{prefix}cert"], out[f"{prefix}key"] = _write(folder / f"{prefix}node", node, node_key)
    return out
