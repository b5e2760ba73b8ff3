#!/usr/bin/env bash
# Base images for docker/compose.yaml on a machine that reaches no image registry, only Debian's
# package repository and PyPI (as the project's CI and development machines do). Podman only.
#
#   docker/local-images.sh
#
# Builds, each only if podman does not have it as its recipe says:
#   localhost/fedbip-debian:bookworm   Debian minbase with python3, made by debootstrap (root)
#   localhost/flwr-local:1.42.0        stand-in for flwr/superlink, flwr/supernode and
#                                      flwr/superexec 1.42.0 (docker/flwr-local.Dockerfile)
#   localhost/flwr-local-torch:1.42.0  the same plus torch from local wheels, the executor's base
#                                      (docker/local-torch.Dockerfile)
# Each image carries the label fedbip.recipe: a hash of what made it (its Dockerfile or the
# debootstrap command, the build arguments and the parent image's ID). An image whose label
# matches is kept, so a second run takes seconds and needs no network; one whose recipe changed
# is rebuilt (podman's layer cache keeps the unchanged steps), and with it every image above it.
# The versions that replaced images leave behind are removed.
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
flwr=localhost/flwr-local:1.42.0
torch=localhost/flwr-local-torch:1.42.0
debootstrap_args=(--variant=minbase --include=python3,python3-venv,ca-certificates bookworm)

for tool in podman debootstrap; do
  command -v "$tool" >/dev/null || { echo "$0 needs '$tool' (apt-get install podman runc debootstrap)" >&2; exit 1; }
done
# Builds reach the package index through the host's network and CA bundle.
build=(podman build --network host --ulimit nofile=20000:20000 -v "/etc/ssl/certs:/etc/ssl/certs:ro")

recipe() {  # FILE|- WORD...: a short hash of what makes an image (its Dockerfile, arguments)
  local file=$1
  shift
  { [[ $file == - ]] || cat "$file"; printf '%s\n' "$@"; } | sha256sum | cut -c1-16
}
image_id() { podman image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }
up_to_date() {  # IMAGE RECIPE
  local label
  label=$(podman image inspect --format '{{index .Labels "fedbip.recipe"}}' "$1" 2>/dev/null) || true
  [[ $label == "$2" ]]
}
replaced=()  # IDs of the versions rebuilt images replace, removed at the end
note() { echo "local-images.sh: $*"; }

key=$(recipe - debootstrap "${debootstrap_args[@]}")
if up_to_date "$debian" "$key"; then
  note "$debian is current"
else
  replaced+=("$(image_id "$debian")")
  root=$(mktemp -d /var/tmp/fedbip-debian.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  debootstrap "${debootstrap_args[@]}" "$root" >/dev/null
  tar -C "$root" -c . | podman import --change "LABEL fedbip.recipe=$key" - "$debian"
  rm -rf "$root"
  trap - EXIT
fi

flwr_args=(--build-arg BASE_IMAGE="$debian" --build-arg PIP_INSTALL_ARGS="--cert $pip_cert")
key=$(recipe "$here/flwr-local.Dockerfile" "${flwr_args[@]}" "$(image_id "$debian")")
if up_to_date "$flwr" "$key"; then
  note "$flwr is current"
else
  replaced+=("$(image_id "$flwr")")
  "${build[@]}" "${flwr_args[@]}" --label "fedbip.recipe=$key" \
    -f "$here/flwr-local.Dockerfile" -t "$flwr" "$here"
fi

key=$(recipe "$here/local-torch.Dockerfile" "$wheel_dirs" "$extra_wheels" "$(image_id "$flwr")")
if up_to_date "$torch" "$key"; then
  note "$torch is current"
else
  replaced+=("$(image_id "$torch")")
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
  "${build[@]}" "${mounts[@]}" --build-arg BASE_IMAGE="$flwr" --label "fedbip.recipe=$key" \
    -f "$here/local-torch.Dockerfile" -t "$torch" "$here"
  rm -rf "$extra"
  trap - EXIT
fi

# Newest first: an old base cannot go while an old image built on it is still there. One still
# used by a container, or by an image built on it elsewhere, stays.
current=" $(image_id "$debian") $(image_id "$flwr") $(image_id "$torch") "
for ((i = ${#replaced[@]} - 1; i >= 0; i--)); do
  old=${replaced[i]}
  if [[ -n $old && $current != *" $old "* ]]; then
    podman rmi "$old" >/dev/null 2>&1 || true
  fi
done

echo "local images ready: $debian $flwr $torch"
