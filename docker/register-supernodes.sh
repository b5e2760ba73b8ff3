#!/bin/sh
# The compose "register" service: register every institution's public key with the SuperLink,
# the step the federation operator performs (by hand, with the keys the institutions sent) in a
# real deployment. Keys: /app/keys/NAME.pub; the SuperLink's CA certificate: /app/keys/ca.crt.
# A key registered before (the SuperLink kept running) is left as it is.
set -eu
export FLWR_HOME=/tmp/flwr-home
mkdir -p "$FLWR_HOME"
cat >"$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "compose"

[superlink.compose]
address = "${SUPERLINK_ADDRESS:-superlink:8000}"
root-certificates = "/app/keys/ca.crt"
TOML

tries=0
until flwr supernode ls >/dev/null 2>&1; do
  tries=$((tries + 1))
  if [ "$tries" -ge 60 ]; then
    echo "register: the SuperLink at ${SUPERLINK_ADDRESS:-superlink:8000} did not answer" >&2
    flwr supernode ls >&2 || true
    exit 1
  fi
  sleep 2
done

for key in /app/keys/*.pub; do
  name=$(basename "$key" .pub)
  if out=$(flwr supernode register "$key" --name "$name" 2>&1); then
    echo "register: $name registered"
  elif echo "$out" | grep -q "already in use"; then
    echo "register: $name was registered before"
  else
    echo "$out" >&2
    exit 1
  fi
done
