# The FedBiP ServerApp / ClientApp executor: Flower's SuperExec with this project installed.
# The same image runs the ServerApp next to the SuperLink and each ClientApp next to its
# SuperNode (flower-superexec picks the task type from the API it connects to).
#
# Build from the repository root:
#   docker build -f docker/superexec.Dockerfile -t fedbip-flwr-superexec:0.1.0 .
# Build arguments:
#   BASE_IMAGE        Flower's official SuperExec image by default; any image with Python 3.11,
#                     flwr 1.41.0 on PATH and a user "app" (uid 49999) works
#   PIP_INSTALL_ARGS  extra pip arguments (an index, certificates, pinned torch variants)
# Model weights, data, credentials and outputs are mounted at run time, never baked in.
ARG BASE_IMAGE=flwr/superexec:1.41.0
FROM ${BASE_IMAGE}
ARG PIP_INSTALL_ARGS=""

USER root
RUN mkdir -p /app/src /app/models /app/outputs /app/data && chown -R app:app /app
USER app
WORKDIR /app/src
# Dependencies first, in a layer that only pyproject.toml invalidates: the project's metadata
# with empty packages. The image already has flwr 1.41.0; the simulation extra (Ray) is not
# needed in an executor, so the pin is kept and the extra dropped.
COPY --chown=app:app pyproject.toml ./
RUN sed -i 's/"flwr\[simulation\]==/"flwr==/' pyproject.toml \
    && grep -q '"flwr==1.41.0"' pyproject.toml \
    && mkdir -p fedbip_flwr client_app server_app \
    && touch README.md fedbip_flwr/__init__.py client_app/__init__.py server_app/__init__.py \
    && python -m pip install --no-cache-dir ${PIP_INSTALL_ARGS} . \
    && python -m pip uninstall -y fedbip-flwr
COPY --chown=app:app README.md ./
COPY --chown=app:app fedbip_flwr fedbip_flwr
COPY --chown=app:app client_app client_app
COPY --chown=app:app server_app server_app
RUN python -m pip install --no-cache-dir --no-deps ${PIP_INSTALL_ARGS} . \
    && python -c "import flwr, client_app.app, server_app.app; assert flwr.__version__ == '1.41.0'"

# Relative paths in the run config (model = "models/miniature-ldm", output-dir = "outputs")
# resolve against /app, where compose mounts the weights and the output volume.
WORKDIR /app
ENV FEDBIP_PROJECT_DIR=/app HF_HUB_OFFLINE=1
ENTRYPOINT ["flower-superexec"]
