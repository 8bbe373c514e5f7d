"""Certificates for a loopback-only cluster: one CA signs every serving and client certificate."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_NAMES = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1",)
VALIDITY = datetime.timedelta(days=7)
FRONT_PROXY_CLIENT = "front-proxy-client"


@dataclasses.dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


@dataclasses.dataclass(frozen=True)
class ClusterPki:
    ca: CertPair
    apiserver: CertPair
    admin: CertPair
    webhook: CertPair
    """Serving certificate of the loopback webhooks and of Kueue's aggregated visibility API server."""
    front_proxy_client: CertPair
    """kube-apiserver's client certificate towards aggregated API servers (the requestheader CA is `ca`)."""
    service_account_key: Path
    service_account_pub: Path

    def ca_pem(self) -> bytes:
        return self.ca.cert.read_bytes()


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(
    directory: Path, stem: str, ca_cert: x509.Certificate, ca_key, subject: x509.Name, server: bool
) -> CertPair:
    key = _new_key()
    builder = _builder(subject, ca_cert.subject, key.public_key()).add_extension(
        x509.BasicConstraints(ca=False, path_length=None), critical=True
    )
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        sans = [x509.DNSName(n) for n in LOOPBACK_NAMES] + [x509.IPAddress(ipaddress.ip_address(i)) for i in LOOPBACK_IPS]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    pair = CertPair(directory / f"{stem}.crt", directory / f"{stem}.key")
    _write_cert(builder.sign(ca_key, hashes.SHA256()), pair.cert)
    _write_key(key, pair.key)
    return pair


def generate(directory: Path) -> ClusterPki:
    """Write a fresh CA, apiserver/webhook serving certs, admin and front-proxy client certs and the service-account keys."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _new_key()
    ca_subject = _name("lorajob-devcluster-ca")
    ca_cert = (
        _builder(ca_subject, ca_subject, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca = CertPair(directory / "ca.crt", directory / "ca.key")
    _write_cert(ca_cert, ca.cert)
    _write_key(ca_key, ca.key)

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sa_key_path, sa_pub_path = directory / "sa.key", directory / "sa.pub"
    _write_key(sa_key, sa_key_path)
    sa_pub_path.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return ClusterPki(
        ca=ca,
        apiserver=_issue(directory, "apiserver", ca_cert, ca_key, _name("kube-apiserver"), server=True),
        admin=_issue(directory, "admin", ca_cert, ca_key, _name("admin", "system:masters"), server=False),
        webhook=_issue(directory, "webhook", ca_cert, ca_key, _name("lorajob-devcluster-webhooks"), server=True),
        front_proxy_client=_issue(directory, "front-proxy-client", ca_cert, ca_key, _name(FRONT_PROXY_CLIENT), server=False),
        service_account_key=sa_key_path,
        service_account_pub=sa_pub_path,
    )
