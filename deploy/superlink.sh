#!/usr/bin/env bash
# Start the federation's SuperLink with TLS and SuperNode authentication (runs in the foreground).
#
#   deploy/superlink.sh CREDENTIALS_DIR [flower-superlink options...]
#
# CREDENTIALS_DIR holds ca.crt, server.pem and server.key (the superlink/ folder written by
# deploy/make-credentials.sh, or the server's real certificate). Further options go to
# flower-superlink, e.g. --host 0.0.0.0 --port 9093 --database state.db.
# Only SuperNodes whose public key was registered with `flwr supernode register` may connect.
# Apps run in the SuperLink's Python environment: this project must be installed there
# (runtime installation of app dependencies is off: the machines need no internet access).
set -euo pipefail
[[ $# -ge 1 ]] || { echo "usage: $0 CREDENTIALS_DIR [flower-superlink options...]" >&2; exit 2; }
dir=$1
shift
for f in ca.crt server.pem server.key; do
  [[ -r $dir/$f ]] || { echo "$0: cannot read $dir/$f" >&2; exit 1; }
done
exec flower-superlink \
  --ssl-ca-certfile "$dir/ca.crt" --ssl-certfile "$dir/server.pem" --ssl-keyfile "$dir/server.key" \
  --enable-supernode-auth --disable-runtime-dependency-installation "$@"
