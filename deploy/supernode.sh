#!/usr/bin/env bash
# Start one institution's SuperNode: TLS to the SuperLink, authenticated by the node's key.
#
#   deploy/supernode.sh CREDENTIALS_DIR SUPERLINK_ADDRESS NODE_CONFIG [flower-supernode options...]
#
# CREDENTIALS_DIR holds ca.crt (the certificate that signed the SuperLink's certificate) and
# node.key (this node's private EC key in OpenSSH format; its node.key.pub must have been
# registered with `flwr supernode register` first). SUPERLINK_ADDRESS is host:port and must
# match a name in the SuperLink certificate. NODE_CONFIG is what this node's ClientApp reads
# from context.node_config, e.g. 'partition-id=0 data-root="/srv/fedbip/data"'.
# Further options go to flower-supernode, e.g. --port 9094 (each SuperNode on one host needs
# its own) or --isolation process. No --trusted-entities: in Flower 1.42 a SuperNode with them
# refuses every FAB not fetched from Flower Hub, this federation's own `flwr run .` included,
# so any app the SuperLink accepts runs here; what guards that is who reaches the SuperLink's
# Control API (docs/deployment.md, "What they cannot enforce with Flower 1.42").
set -euo pipefail
[[ $# -ge 3 ]] || {
  echo "usage: $0 CREDENTIALS_DIR SUPERLINK_ADDRESS NODE_CONFIG [flower-supernode options...]" >&2
  exit 2
}
dir=$1 superlink=$2 node_config=$3
shift 3
for f in ca.crt node.key; do
  [[ -r $dir/$f ]] || { echo "$0: cannot read $dir/$f" >&2; exit 1; }
done
exec flower-supernode --superlink "$superlink" \
  --root-certificates "$dir/ca.crt" --auth-supernode-private-key "$dir/node.key" \
  --node-config "$node_config" "$@"
