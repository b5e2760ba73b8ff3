# The FedBiP ServerApp / ClientApp executor: Flower's SuperExec with this project installed.
# The same image runs the ServerApp next to the SuperLink and each ClientApp next to its
# SuperNode (flower-superexec picks the task type from the API it connects to).
#
# Build from the repository root:
#   docker build -f docker/superexec.Dockerfile -t fedbip-flwr-superexec:0.1.0 .
# Build arguments:
#   BASE_IMAGE        Flower's official SuperExec image by default; any image with Python 3.11,
#                     flwr 1.42.0 on PATH and a user "app" (uid 49999) works
#   PIP_INSTALL_ARGS  extra pip arguments (an index, certificates, pinned torch variants)
# Model weights, data, credentials and outputs are mounted at run time, never baked in.
ARG BASE_IMAGE=flwr/superexec:1.42.0

# The project's runtime requirements, read from pyproject.toml in a stage of their own: the
# install below then depends on this list alone, so editing anything else in pyproject.toml
# (run config defaults, tool settings) reuses the cached dependency layer. The image already has
# flwr 1.42.0; the simulation extra (Ray) is not needed in an executor, so the pin is kept and
# the extra dropped.
FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import sys; \
tomllib = __import__('tomllib' if sys.version_info >= (3, 11) else 'pip._vendor.tomli', \
                     fromlist=['load']); \
deps = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']; \
deps = [d.replace('flwr[simulation]==', 'flwr==') for d in deps]; \
assert 'flwr==1.42.0' in deps, deps; \
print(chr(10).join(deps))" > /tmp/requirements.txt

FROM ${BASE_IMAGE}
ARG PIP_INSTALL_ARGS=""

USER root
RUN mkdir -p /app/src /app/models /app/outputs /app/data && chown -R app:app /app
USER app
WORKDIR /app/src
COPY --from=requirements /tmp/requirements.txt /tmp/requirements.txt
RUN python -m pip install --no-cache-dir ${PIP_INSTALL_ARGS} -r /tmp/requirements.txt
COPY --chown=app:app pyproject.toml ./
COPY --chown=app:app README.md ./
# What executors run, as fab-include ships it; fedbip_tools (the CLI, benchmark, builders) is for
# people and stays out, so the image's `fedbip` console script is not usable here.
COPY --chown=app:app fedbip_flwr fedbip_flwr
COPY --chown=app:app client_app client_app
COPY --chown=app:app server_app server_app
RUN python -m pip install --no-cache-dir --no-deps ${PIP_INSTALL_ARGS} . \
    && python -c "import flwr, client_app.app, server_app.app; assert flwr.__version__ == '1.42.0'"

# Relative paths in the run config (ldm.model = "models/miniature-ldm", output-dir = "outputs")
# resolve against /app, where compose mounts the weights and the output volume.
WORKDIR /app
ENV FEDBIP_PROJECT_DIR=/app HF_HUB_OFFLINE=1
ENTRYPOINT ["flower-superexec"]
