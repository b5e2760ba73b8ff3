# Offline stand-in for Flower's official images (flwr/superlink, flwr/supernode and
# flwr/superexec 1.42.0) where no image registry can be reached: flwr 1.42.0 in a venv on
# PATH, user "app" with uid 49999, working directory /app, like the official ones. It has no
# entrypoint; compose.yaml names flower-superlink / flower-supernode / flower-superexec itself.
# Built by docker/local-images.sh on a Debian base made with debootstrap.
ARG BASE_IMAGE=localhost/fedbip-debian:bookworm
FROM ${BASE_IMAGE}
ARG PIP_INSTALL_ARGS=""
RUN useradd --uid 49999 --user-group --home-dir /app --create-home app \
    && python3 -m venv /python/venv \
    && chown -R app:app /python
ENV PATH=/python/venv/bin:$PATH HOME=/app
USER app
WORKDIR /app
RUN python -m pip install --no-cache-dir ${PIP_INSTALL_ARGS} flwr==1.42.0
