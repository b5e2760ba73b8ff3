#!/usr/bin/env bash
# The whole secured federation on one host, end to end, then everything stopped again:
# throwaway credentials, a SuperLink with TLS and SuperNode authentication, N registered
# SuperNodes (one per institution, each with its own image folder, domain phrase, client id
# and output folder in its node config; the server holds no image), and `flwr run` of this
# project through them with dataset "imagefolder". The run asks for a DP upload by default
# (fedbip-mixture at epsilon 4, what each institution's default upload policy requires) and binds
# every client id to its registered node (federation.client-nodes), both written by
# docker/register-supernodes.sh, as in compose.
#
#   deploy/demo.sh [-n NUM_SUPERNODES] [-p PORT] [-k SHOTS] [-t TEST_PER_CLASS] [-c I:NODE_CONFIG]... WORK_DIR [flwr run options...]
#
#   -n  SuperNodes to start (default 3)
#   -p  SuperLink port on 127.0.0.1 (default 9093); SuperNode i uses PORT+1+i for its local API
#   -k  training images per class in each institution's folder (default 16)
#   -t  held-out images per class in each institution's folder (default 50)
#   -c  more node config for institution I (0-based), e.g. its upload policy:
#       -c 2:'max-dp-epsilon=1' (docs/institutions.md); repeat it for more institutions
#   WORK_DIR receives credentials/ (reused if present; credentials/operator/run-config is the
#   run config registration wrote), logs/, data/institution-I/ (institution I's folder: domain
#   sketch, quickdraw or painting of the built-in world, written by `fedbip shapes-folder` unless
#   it exists), institutions/institution-I/ (where institution I keeps the classifier it gets
#   back and the record of what it uploaded) and flwr-home/ (the flwr CLI's connection
#   "fedbip-tls"). Remaining options go to `flwr run` after the run config above, so they win,
#   e.g. --run-config 'fedbip-mixture.dp-epsilon=2.0'. FedBiP's own upload (z(T), no guarantee)
#   is --run-config 'method="fedbip"' with -c I:'require-dp=false' for every institution I.
#
# Exit status 0 only if the run finished with status finished:completed.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
usage() { echo "usage: $0 [-n NUM_SUPERNODES] [-p PORT] [-k SHOTS] [-t TEST_PER_CLASS] [-c I:NODE_CONFIG]... WORK_DIR [flwr run options...]" >&2; exit 2; }

num=3
port=9093
shots=16
test_per_class=50
declare -A own_config=()
while getopts "n:p:k:t:c:" opt; do
  case $opt in
    n) num=$OPTARG ;;
    p) port=$OPTARG ;;
    k) shots=$OPTARG ;;
    t) test_per_class=$OPTARG ;;
    c) [[ $OPTARG =~ ^([0-9]+):(.*)$ ]] || usage; own_config[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]} ;;
    *) usage ;;
  esac
done
shift $((OPTIND - 1))
[[ $# -ge 1 ]] || usage
mkdir -p "$1"
work=$(cd "$1" && pwd)
shift

creds=$work/credentials
logs=$work/logs
connection=fedbip-tls
export FLWR_HOME=$work/flwr-home
mkdir -p "$logs" "$FLWR_HOME"

pids=()
descendants() {
  local child
  for child in $(pgrep -P "$1" || true); do
    descendants "$child"
    echo "$child"
  done
}
stop_all() {
  local pid family=()
  for pid in "${pids[@]}"; do
    # shellcheck disable=SC2207  # one PID per word
    family+=($(descendants "$pid") "$pid")
  done
  [[ ${#family[@]} -gt 0 ]] || return 0
  kill "${family[@]}" 2>/dev/null || true
  for _ in $(seq 75); do
    kill -0 "${family[@]}" 2>/dev/null || return 0
    sleep 0.2
  done
  kill -9 "${family[@]}" 2>/dev/null || true
}
trap stop_all EXIT

fail() {
  echo "demo: $1" >&2
  [[ $# -lt 2 ]] || tail -n 30 "$2" >&2
  exit 1
}

# 1. Credentials (what each party would hold; see docs/deployment.md).
if [[ ! -e $creds/ca/ca.crt ]]; then
  "$here/make-credentials.sh" "$creds" "$num"
fi
for ((i = 0; i < num; i++)); do
  [[ -e $creds/supernode-$i/node.key ]] || fail "$creds has no key for supernode-$i; remove it to start afresh"
done

# 2. The SuperLink (the server's institution).
"$here/superlink.sh" "$creds/superlink" --host 127.0.0.1 --port "$port" >"$logs/superlink.log" 2>&1 &
pids+=($!)
for _ in $(seq 120); do
  kill -0 "${pids[0]}" 2>/dev/null || fail "the SuperLink exited during start-up" "$logs/superlink.log"
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  sleep 0.5
done
(exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || fail "the SuperLink does not listen on port $port" "$logs/superlink.log"

# 3. The flwr CLI's connection: the SuperLink's address and the CA that signed its certificate.
cat >"$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "$connection"

[superlink.$connection]
address = "127.0.0.1:$port"
root-certificates = "$creds/ca/ca.crt"
EOF

# 4. Register every institution's public key under its client id (the operator's step, which
#    also writes the run config binding each client id to its node id), then start its
#    SuperNode with its private key.
domains=(sketch quickdraw painting)
client_ids=()
keys=$work/keys
rm -rf "$keys" && mkdir -p "$keys"
for ((i = 0; i < num; i++)); do
  client_ids+=("${domains[i % ${#domains[@]}]}-$((i / ${#domains[@]}))")
  cp "$creds/supernode-$i/node.key.pub" "$keys/${client_ids[i]}.pub"
done
run_config=$creds/operator/run-config
mkdir -p "$creds/operator"
sh "$root/docker/register-supernodes.sh" "$keys" "$run_config" >>"$logs/register.log" 2>&1 ||
  fail "could not register the SuperNodes" "$logs/register.log"
for ((i = 0; i < num; i++)); do
  domain=${domains[i % ${#domains[@]}]}
  data=$work/data/institution-$i
  [[ -d $data/train ]] || fedbip shapes-folder "$domain" "$data" --shots "$shots" \
    --test-per-class "$test_per_class" --client-index $((i / ${#domains[@]})) >>"$logs/data.log"
  node_config="data-root=\"$data\" domain=\"$domain\" client-id=\"${client_ids[i]}\""
  node_config+=" output-dir=\"$work/institutions/institution-$i\" ${own_config[$i]:-}"
  "$here/supernode.sh" "$creds/supernode-$i" "127.0.0.1:$port" "$node_config" \
    --port $((port + 1 + i)) >"$logs/supernode-$i.log" 2>&1 &
  pids+=($!)
done

# 5. Wait until all SuperNodes are online, so that every institution takes part.
online=0
for _ in $(seq 60); do
  for ((i = 1; i <= num; i++)); do
    kill -0 "${pids[i]}" 2>/dev/null || fail "supernode-$((i - 1)) exited" "$logs/supernode-$((i - 1)).log"
  done
  online=$(flwr supernode ls "$connection" --format json 2>/dev/null |
    python3 -c 'import json, sys; print(sum(n["status"] == "online" for n in json.load(sys.stdin)["nodes"]))' ||
    echo 0)
  [[ $online -ge $num ]] && break
  sleep 2
done
[[ $online -ge $num ]] || fail "only $online of $num SuperNodes came online" "$logs/superlink.log"
echo "demo: SuperLink on 127.0.0.1:$port (TLS, SuperNode authentication), $num SuperNodes online after ${SECONDS}s"

# 6. The run, streamed; its final status decides the exit code.
cd "$root"
# The run config: registration's (the upload, federation.client-nodes) and the shared classes; each
# institution named its own data above.
classes=$(python3 -c 'from fedbip_flwr.shapes import CLASSES; print(",".join(CLASSES))')
flwr run . "$connection" --stream \
  --run-config "$(cat "$run_config") \"data.dataset\"=\"imagefolder\" \"data.classes\"=\"$classes\"" "$@" 2>&1 |
  tee "$logs/flwr-run.log"
run_id=$(sed -n 's/.*Successfully started run \([0-9]\+\).*/\1/p' "$logs/flwr-run.log" | head -n 1)
[[ -n $run_id ]] || fail "flwr run did not start a run" "$logs/flwr-run.log"
status=$(flwr ls "$connection" --run-id "$run_id" --format json |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["runs"][0]["status"])')
echo "demo: run $run_id $status after ${SECONDS}s"
[[ $status == finished:completed ]]
