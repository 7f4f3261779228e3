#!/usr/bin/env bash
# Make a CA, one certificate per name and a bearer token for a graphfeed cluster with
# mutual TLS (see docs/operations.md, "Security").
#
#   deploy/make-certs.sh OUT_DIR [NAME ...]     (default names: the compose cluster's)
#
# Every certificate is valid for its NAME, localhost and 127.0.0.1, for both server and
# client use (servers present theirs to their peers too). Needs openssl. Keys are written
# with mode 600; keep OUT_DIR/ca.key away from the cluster.
set -euo pipefail
out=${1:?usage: make-certs.sh OUT_DIR [NAME ...]}
shift
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(server0 server1 trainer0 trainer1)
mkdir -p "$out"
cd "$out"
umask 077
if [ ! -f ca.crt ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
      -subj "/CN=graphfeed CA" -keyout ca.key -out ca.crt 2>/dev/null
fi
for name in "${names[@]}"; do
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$name" \
      -keyout "$name.key" -out "$name.csr" 2>/dev/null
  printf "subjectAltName=DNS:%s,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n" \
      "$name" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
      -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
done
[ -f token ] || openssl rand -base64 32 > token
chmod 644 ./*.crt
echo "certificates for ${names[*]} and a token in $out"
