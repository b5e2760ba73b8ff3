#!/usr/bin/env bash
# Start the federation's SuperLink with TLS and SuperNode authentication (runs in the foreground).
#
#   deploy/superlink.sh CREDENTIALS_DIR --host ADDRESS [flower-superlink options...]
#
# CREDENTIALS_DIR holds ca.crt, server.pem and server.key (the superlink/ folder written by
# deploy/make-credentials.sh, or the server's real certificate). --host is required: the one
# port it opens carries the Fleet API (SuperNodes), the Runtime API (executors) and the Control
# API (`flwr run`, `flwr supernode register`), which open-source Flower 1.42 does not
# authenticate: whoever reaches the port and trusts its certificate can register a key or run
# an app on every institution's SuperNode. So name the address deliberately: 127.0.0.1 when
# everything runs on this host; otherwise the interface the institutions reach, with a firewall
# (or reverse proxy) that admits only the registered institutions' addresses and the operator's
# (docs/deployment.md, "What the shipped files enforce"). A wildcard (0.0.0.0, ::) is allowed
# but warned about. Further options go to flower-superlink, e.g. --port 9093 --database state.db.
# Only SuperNodes whose public key was registered with `flwr supernode register` may connect.
# Apps run in the SuperLink's Python environment: this project must be installed there
# (runtime installation of app dependencies is off: the machines need no internet access).
set -euo pipefail
usage() {
  echo "usage: $0 CREDENTIALS_DIR --host ADDRESS [flower-superlink options...]" >&2
  exit 2
}
[[ $# -ge 1 ]] || usage
dir=$1
shift
for f in ca.crt server.pem server.key; do
  [[ -r $dir/$f ]] || { echo "$0: cannot read $dir/$f" >&2; exit 1; }
done
host=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --host) host=${args[i + 1]:-} ;;
    --host=*) host=${args[i]#--host=} ;;
  esac
done
if [[ -z $host ]]; then
  echo "$0: name the address to listen on with --host (127.0.0.1 for this host only): the" \
    "port carries Flower's unauthenticated Control API, see docs/deployment.md" >&2
  usage
fi
case $host in
  0.0.0.0 | :: | "[::]")
    echo "$0: warning: listening on every interface ($host); the unauthenticated Control API" \
      "shares this port, so a firewall must admit only the institutions and the operator" >&2 ;;
esac
# Set to 1, these internal variables of Flower 1.42 would also open its legacy gRPC Control and
# Fleet APIs on 0.0.0.0:9093 and 0.0.0.0:9092, whatever --host says.
unset FLWR_INTERNAL_GRPC_CONTROL_API FLWR_INTERNAL_GRPC_FLEET_API
exec flower-superlink \
  --ssl-ca-certfile "$dir/ca.crt" --ssl-certfile "$dir/server.pem" --ssl-keyfile "$dir/server.key" \
  --enable-supernode-auth --disable-runtime-dependency-installation "$@"
