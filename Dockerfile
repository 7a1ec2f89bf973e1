# One image for every swarm-mesh service: `swarm coordinator|server|train|status|export`.
#
#   docker build -t swarm-mesh:0.1.0 .                                  # CPU (default)
#   docker build --build-arg DEVICE=cuda -t swarm-mesh:0.1.0-cuda .     # NVIDIA GPUs
#
# DEVICE=cpu  installs torch's CPU wheel from PyTorch's CPU index: no CUDA packages.
# DEVICE=cuda installs torch's CUDA build from PyPI. That wheel brings the CUDA runtime
#             libraries with it (the nvidia-* wheels), so the base needs only Python; the
#             host supplies the driver (NVIDIA Container Toolkit; on Kubernetes, the
#             NVIDIA device plugin). The image defaults to SWARM_DEVICE=cuda.
#
# Containers log JSON lines (SWARM_LOG_FORMAT=json) and listen on every interface
# (SWARM_HOST=0.0.0.0); the coordinator listens on 8000, a stage server on 8100.
# /data belongs to the swarm user: mount the coordinator's volume there
# (SWARM_STATE_DB=/data/coordinator.sqlite, SWARM_CHECKPOINT_DIR=/data/checkpoints).
ARG PYTHON_IMAGE=python:3.11-slim
ARG DEVICE=cpu
ARG TORCH_VERSION=2.13.0

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch in its own layer, before the project: it is by far the largest and changes least.
FROM base AS torch-cpu
ARG TORCH_VERSION
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu

FROM base AS torch-cuda
ARG TORCH_VERSION
RUN pip install "torch==${TORCH_VERSION}"
ENV SWARM_DEVICE=cuda

FROM torch-${DEVICE} AS app
ARG TORCH_VERSION
COPY pyproject.toml README.md /src/
COPY shared /src/shared
COPY services /src/services
# torch is already there and satisfies the project's requirement: pip keeps it.
RUN pip install /src \
    && python -c "import torch, services.cli; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__" \
    && groupadd --gid 10001 swarm \
    && useradd --create-home --uid 10001 --gid 10001 swarm \
    && install -d -o swarm -g swarm /data
ENV SWARM_LOG_FORMAT=json \
    SWARM_HOST=0.0.0.0
USER 10001:10001
WORKDIR /data
EXPOSE 8000 8100
CMD ["swarm", "--help"]
