#!/usr/bin/env bash
# Throwaway credentials for a demo federation (never for production; see docs/deployment.md).
#
#   deploy/make-credentials.sh [-o OWNER] OUT_DIR NUM_SUPERNODES [EXTRA_SAN_NAME...]
#
#   -o OWNER  chown the SuperLink's, SuperNodes' and operator's folders to OWNER (e.g. 49999,
#             the user in Flower's container images, which must read the mounted private keys
#             and write the operator's run config; needs root)
#
# Writes, with openssl and ssh-keygen:
#   OUT_DIR/ca/ca.crt                       the demo CA's certificate. Its private key is made
#                                           in a private temporary folder, signs the SuperLink's
#                                           certificate once and is deleted: it is nowhere in
#                                           OUT_DIR, so nothing handed out can sign another
#                                           certificate (new credentials mean a new CA)
#   OUT_DIR/superlink/server.pem, server.key  the SuperLink's TLS certificate, signed by the CA,
#                                           valid for localhost, 127.0.0.1 and EXTRA_SAN_NAMEs
#                                           (e.g. the compose service name "superlink")
#   OUT_DIR/superlink/ca.crt                copy of the CA certificate (--ssl-ca-certfile)
#   OUT_DIR/superlink/superexec.secret      shared secret of the SuperLink and its ServerApp
#                                           executor in process isolation (compose), so that
#                                           nothing else can take the ServerApp's task
#   OUT_DIR/supernode-I/node.key, node.key.pub  SuperNode I's EC P-384 key pair, OpenSSH format
#                                           (read by flower-supernode and `flwr supernode register`)
#   OUT_DIR/supernode-I/ca.crt              copy of the CA certificate (--root-certificates)
#   OUT_DIR/operator/                       empty: where the operator's registration
#                                           (docker/register-supernodes.sh) writes the run
#                                           config binding each client id to its node id
# Each folder holds exactly what one party needs, so it can be handed over (or mounted) alone;
# the only private keys anywhere in OUT_DIR are server.key and each node.key, in their owners'
# folders.
set -euo pipefail

usage() { echo "usage: $0 [-o OWNER] OUT_DIR NUM_SUPERNODES [EXTRA_SAN_NAME...]" >&2; exit 2; }
owner=""
while getopts "o:" opt; do
  case $opt in
    o) owner=$OPTARG ;;
    *) usage ;;
  esac
done
shift $((OPTIND - 1))
[[ $# -ge 2 ]] || usage
out=$1 num=$2
shift 2
[[ $num =~ ^[1-9][0-9]*$ ]] || {
  echo "NUM_SUPERNODES must be a positive integer, got '$num'" >&2
  exit 2
}
for tool in openssl ssh-keygen; do
  command -v "$tool" >/dev/null || { echo "$0 needs '$tool' on PATH" >&2; exit 1; }
done
if [[ -e $out/ca/ca.crt ]]; then
  echo "$out already holds credentials; remove it first to make new ones" >&2
  exit 1
fi

umask 077
mkdir -p "$out/ca" "$out/superlink" "$out/operator"
days=30
# The CA's private key and serial file live only here, removed on exit (also on failure).
ca_private=$(mktemp -d)
trap 'rm -rf "$ca_private"' EXIT

# 1. The certificate authority.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-384 -nodes -days "$days" \
  -subj "/CN=FedBiP demo CA" -keyout "$ca_private/ca.key" -out "$out/ca/ca.crt" 2>/dev/null

# 2. The SuperLink's server certificate: the SANs must cover every address clients dial.
sans="DNS:localhost,IP:127.0.0.1"
for name in "$@"; do
  if [[ $name =~ ^[0-9.]+$ ]]; then sans+=",IP:$name"; else sans+=",DNS:$name"; fi
done
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-384 -nodes -subj "/CN=fedbip-superlink" \
  -keyout "$out/superlink/server.key" -out "$out/superlink/server.csr" 2>/dev/null
openssl x509 -req -in "$out/superlink/server.csr" -CA "$out/ca/ca.crt" \
  -CAkey "$ca_private/ca.key" -CAserial "$ca_private/ca.srl" -CAcreateserial \
  -days "$days" -out "$out/superlink/server.pem" \
  -extfile <(printf '%s\n' "subjectAltName=$sans" basicConstraints=CA:FALSE \
    keyUsage=digitalSignature extendedKeyUsage=serverAuth) 2>/dev/null
rm "$out/superlink/server.csr"
rm -rf "$ca_private"   # the CA has signed its one certificate; its key is gone
cp "$out/ca/ca.crt" "$out/superlink/ca.crt"
openssl rand -hex 32 >"$out/superlink/superexec.secret"

# 3. One EC key pair per SuperNode (institution). Only the .pub leaves the institution.
for ((i = 0; i < num; i++)); do
  dir="$out/supernode-$i"
  mkdir -p "$dir"
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "supernode-$i" -f "$dir/node.key"
  cp "$out/ca/ca.crt" "$dir/ca.crt"
done

# Certificates and public keys are public; private keys stay owner-only.
chmod 644 "$out"/ca/ca.crt "$out"/superlink/*.pem "$out"/*/ca.crt "$out"/supernode-*/node.key.pub
chmod 755 "$out" "$out"/*/
if [[ -n $owner ]]; then
  chown -R "$owner:$owner" "$out/superlink" "$out"/supernode-* "$out/operator"
fi
echo "credentials in $out: CA, SuperLink certificate for $sans, $num SuperNode key pair(s)"
