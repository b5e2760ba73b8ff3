# Offline only: the stand-in Flower image (flwr-local.Dockerfile) plus torch and torchvision
# installed from wheel folders on this machine, with no package index at all, so that building
# the executor image never downloads the multi-GB torch stack. docker/local-images.sh mounts
# the folders under /wheels. torch's CPU-only wheel cannot be paired with PyPI's torchvision
# (whose ops need libtorch_cuda), so the regular CUDA build of both is used; it runs on CPU.
ARG BASE_IMAGE=localhost/flwr-local:1.42.0
FROM ${BASE_IMAGE}
ARG TORCH_REQUIREMENTS="torch==2.14.1 torchvision==0.29.1"
RUN links="" \
    && for dir in /wheels/*/; do links="$links --find-links $dir"; done \
    && python -m pip install --no-cache-dir --no-index $links ${TORCH_REQUIREMENTS} \
    && python -c "import torch, torchvision"
