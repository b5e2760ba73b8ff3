#!/usr/bin/env bash
# Base images for docker/compose.yaml on a machine that reaches no image registry, only Debian's
# package repository and PyPI (as the project's CI and development machines do). Podman only.
#
#   docker/local-images.sh
#
# Builds, each only if podman does not have it yet:
#   localhost/fedbip-debian:bookworm   Debian minbase with python3, made by debootstrap (root)
#   localhost/flwr-local:1.41.0        stand-in for flwr/superlink, flwr/supernode and
#                                      flwr/superexec 1.41.0 (docker/flwr-local.Dockerfile)
#   localhost/flwr-local-torch:1.41.0  the same plus torch from local wheels, the executor's base
#                                      (docker/local-torch.Dockerfile)
# Environment:
#   LOCAL_WHEEL_DIRS  folders of wheels for torch and its dependencies
#                     (default: "/opt/pypi/files /opt/pypi-more/files /opt/wheels")
#   EXTRA_WHEELS      requirements those folders lack, fetched once from the package index
#                     (default: torch 2.14.1's cuda-bindings)
#   PIP_CERT          CA bundle for pip inside builds (default: /etc/ssl/certs/ca-certificates.crt)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
wheel_dirs=${LOCAL_WHEEL_DIRS:-/opt/pypi/files /opt/pypi-more/files /opt/wheels}
extra_wheels=${EXTRA_WHEELS:-cuda-bindings>=13.0.3,<14}
pip_cert=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
debian=localhost/fedbip-debian:bookworm
flwr=localhost/flwr-local:1.41.0
torch=localhost/flwr-local-torch:1.41.0

for tool in podman debootstrap; do
  command -v "$tool" >/dev/null || { echo "$0 needs '$tool' (apt-get install podman runc debootstrap)" >&2; exit 1; }
done
# Builds reach the package index through the host's network and CA bundle.
build=(podman build --network host --ulimit nofile=20000:20000 -v "/etc/ssl/certs:/etc/ssl/certs:ro")

if ! podman image exists "$debian"; then
  root=$(mktemp -d /var/tmp/fedbip-debian.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root"
  tar -C "$root" -c . | podman import - "$debian"
  rm -rf "$root"
  trap - EXIT
fi

if ! podman image exists "$flwr"; then
  "${build[@]}" --build-arg BASE_IMAGE="$debian" --build-arg PIP_INSTALL_ARGS="--cert $pip_cert" \
    -f "$here/flwr-local.Dockerfile" -t "$flwr" "$here"
fi

if ! podman image exists "$torch"; then
  extra=$(mktemp -d /var/tmp/fedbip-wheels.XXXXXX)
  trap 'rm -rf "$extra"' EXIT
  chmod 755 "$extra"
  # shellcheck disable=SC2086  # one requirement per word
  python3 -m pip download --quiet --no-deps --dest "$extra" $extra_wheels
  mounts=(-v "$extra:/wheels/extra:ro")
  i=0
  for dir in $wheel_dirs; do
    [[ -d $dir ]] || { echo "$0: LOCAL_WHEEL_DIRS names '$dir', which is no folder" >&2; exit 1; }
    mounts+=(-v "$dir:/wheels/local-$i:ro")
    i=$((i + 1))
  done
  "${build[@]}" "${mounts[@]}" --build-arg BASE_IMAGE="$flwr" \
    -f "$here/local-torch.Dockerfile" -t "$torch" "$here"
  rm -rf "$extra"
  trap - EXIT
fi

echo "local images ready: $debian $flwr $torch"
