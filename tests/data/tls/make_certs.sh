#!/usr/bin/env bash
# Regenerates the test certificates (tests/data/tls): a test CA, two server certificates signed by
# it (localhost and 127.0.0.1; CN hstu-test-server-1 and -2, for the reload test), a client
# certificate signed by it, an untrusted CA with a client certificate of its own, a 1024-bit
# (too weak) self-signed server certificate and an expired one. Valid for
# 100 years; the keys are test keys, used by nothing else.
set -euo pipefail
cd "$(dirname "$0")"
days=36500
ca() {  # name
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.crt" -days $days \
    -subj "/CN=$1" -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}
leaf() {  # name ca ext
  openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$1" 2>/dev/null
  openssl x509 -req -in "$1.csr" -CA "$2.crt" -CAkey "$2.key" -CAcreateserial -out "$1.crt" \
    -days $days -extfile <(printf '%s\n' "$3") 2>/dev/null
  rm -f "$1.csr"
}
ca test-ca
ca untrusted-ca
# A 1024-bit RSA key: OpenSSL's default security level (2) refuses it, so the start-up check must.
openssl req -x509 -newkey rsa:1024 -nodes -keyout weak-server.key -out weak-server.crt -days $days \
  -subj "/CN=weak-server" 2>/dev/null
for n in 1 2; do
  leaf "hstu-test-server-$n" test-ca "subjectAltName=DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
done
leaf hstu-test-client test-ca "extendedKeyUsage=clientAuth"
leaf untrusted-client untrusted-ca "extendedKeyUsage=clientAuth"
rm -f ./*.srl test-ca.key untrusted-ca.key
# An expired server certificate (self-signed, 2020-01-01 to 2020-01-02) with its key, for the
# start-up check; OpenSSL 3.0's command line cannot backdate one, Python's cryptography can.
python3 - <<'PY'
import datetime
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expired-server")])
cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime.datetime(2020, 1, 1)).not_valid_after(datetime.datetime(2020, 1, 2))
        .sign(key, hashes.SHA256()))
open("expired-server.crt", "wb").write(cert.public_bytes(serialization.Encoding.PEM))
open("expired-server.key", "wb").write(key.private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()))
PY
