"""A throwaway CA and one certificate it signed, for TLS tests: made with the `openssl`
CLI (the `cryptography` package is not a dependency). The certificate serves both ends
(serverAuth and clientAuth) and names 127.0.0.1, localhost and `SERVER_NAME`."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_NAME = "pdserve-internal"
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certs:
    ca: str      # the CA's certificate (what clients verify servers with, and servers clients)
    cert: str    # a certificate the CA signed, for servers and clients alike
    key: str
    other_ca: str  # an unrelated CA: a client trusting it must not accept `cert`


def make_certs(out: Path) -> Certs:
    ca, other = _ca(out, "ca"), _ca(out, "other-ca")
    ext = out / "leaf.ext"
    ext.write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:{SERVER_NAME}\n"
                   "extendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n")
    _run("req", *_EC, "-keyout", out / "tls.key", "-out", out / "tls.csr", "-subj", f"/CN={SERVER_NAME}")
    _run("x509", "-req", "-in", out / "tls.csr", "-CA", ca, "-CAkey", out / "ca.key", "-CAcreateserial",
         "-out", out / "tls.crt", "-days", "2", "-extfile", ext)
    return Certs(str(ca), str(out / "tls.crt"), str(out / "tls.key"), str(other))


def _ca(out: Path, name: str) -> Path:
    _run("req", "-x509", *_EC, "-keyout", out / f"{name}.key", "-out", out / f"{name}.crt", "-days", "2",
         "-subj", f"/CN=pdserve test {name}", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return out / f"{name}.crt"


def _run(*args) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)
