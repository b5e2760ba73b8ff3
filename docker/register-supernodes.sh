#!/bin/sh
# The federation operator's step before a run: register every institution's public key with the
# SuperLink, then write the run config that binds each institution's client id to the node id
# its key was registered under (run config federation.client-nodes: an upload under that id from any other
# node is refused, so no node can take an institution's id).
#
#   register-supernodes.sh KEYS_DIR RUN_CONFIG_FILE
#
# KEYS_DIR/CLIENT_ID.pub is each institution's public key, named by the client id in its node
# config. The flwr CLI's default connection must reach the SuperLink, or SUPERLINK_ADDRESS and
# CA_CERT name it (compose's "register" service). RUN_CONFIG_FILE receives one line for
# `flwr run --run-config`: FEDBIP_RUN_CONFIG (default: the DP upload below, which a real
# institution's default upload policy accepts; docs/institutions.md) and federation.client-nodes.
# A key registered before (the SuperLink kept running) is left as it is, and so is the file
# written when it was registered: its node id is known only from that registration.
set -eu
keys=$1 out=$2
# Table keys quoted whole: flwr merges --run-config lines table by table, so a later line's
# fedbip-mixture.KEY=... (federation.KEY=...) would drop an unquoted fedbip-mixture.dp-epsilon
# (federation.client-nodes).
: "${FEDBIP_RUN_CONFIG:=method=\"fedbip-mixture\" \"fedbip-mixture.dp-epsilon\"=4.0}"

if [ -n "${SUPERLINK_ADDRESS:-}" ]; then
  export FLWR_HOME=/tmp/flwr-home
  mkdir -p "$FLWR_HOME"
  cat >"$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "operator"

[superlink.operator]
address = "$SUPERLINK_ADDRESS"
root-certificates = "${CA_CERT:?CA_CERT names the certificate that signed the SuperLink's}"
TOML
fi

tries=0
until flwr supernode ls >/dev/null 2>&1; do
  tries=$((tries + 1))
  if [ "$tries" -ge 60 ]; then
    echo "register: the SuperLink did not answer" >&2
    flwr supernode ls >&2 || true
    exit 1
  fi
  sleep 2
done

bound="" before=""
for key in "$keys"/*.pub; do
  name=$(basename "$key" .pub)
  if out_text=$(flwr supernode register "$key" --name "$name" 2>&1); then
    echo "register: $name: $out_text"
    node=$(echo "$out_text" | sed -n 's/.*SuperNode \([0-9][0-9]*\) registered successfully.*/\1/p')
    [ -n "$node" ] || { echo "register: no node id for $name in: $out_text" >&2; exit 1; }
    bound="${bound:+$bound,}$name=$node"
  elif echo "$out_text" | grep -q "already in use"; then
    echo "register: $name was registered before"
    before="$before $name"
  else
    echo "$out_text" >&2
    exit 1
  fi
done

if [ -n "$before" ]; then
  [ -z "$bound" ] && [ -e "$out" ] || {
    echo "register:$before registered before, others now: their node ids are not all known" >&2
    exit 1
  }
  echo "register: keeping $out, written when they were registered"
  exit 0
fi
printf '%s "federation.client-nodes"="%s"\n' "$FEDBIP_RUN_CONFIG" "$bound" >"$out"
echo "register: run config for flwr run in $out: $(cat "$out")"
