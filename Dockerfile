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
# Where the base and torch come from are build arguments, so that the same file builds on a
# machine with no image registry and no route to PyTorch's index (`make compose`,
# .ci/compose.py, does that here):
#   BASE_IMAGE       an image with python3 (3.11, the wheel's) and its venv module: the
#                    official Python image by default, or one built from Debian's packages;
#   TORCH_INDEX_URL  the index torch is installed from (default: PyTorch's CPU index for
#                    DEVICE=cpu, PyPI for DEVICE=cuda);
#   .ci/image-extras/  wheels (*.whl) found before any index, and ca.crt, a CA bundle for a
#                    package index behind a TLS-inspecting proxy. Empty but for its README on a
#                    normal machine; the wheels stay out of the final image.
# One stage installs torch and the final stage copies its venv: the classic builder (Debian's
# docker-compose 1.29) builds every stage of a file, so no stage may install a torch it
# does not use.
#
# Containers log JSON lines (SWARM_LOG_FORMAT=json) and listen on every interface
# (SWARM_HOST=0.0.0.0); the coordinator listens on 8000, a stage server on 8100.
# /data belongs to the swarm user: mount the coordinator's volume there
# (SWARM_STATE_DB=/data/coordinator.sqlite, SWARM_CHECKPOINT_DIR=/data/checkpoints).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
# A venv: Debian's own python3 refuses installs into the system (PEP 668).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# torch in its own stage, before the project: it is by far the largest and changes least.
FROM base AS torch
ARG DEVICE=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
COPY .ci/image-extras/ /opt/image-extras/
RUN set -e; \
    if [ -s /opt/image-extras/ca.crt ]; then export PIP_CERT=/opt/image-extras/ca.crt; fi; \
    index="${TORCH_INDEX_URL}"; \
    if [ -z "$index" ] && [ "$DEVICE" = cpu ]; then index=https://download.pytorch.org/whl/cpu; fi; \
    if [ -z "$index" ]; then index=https://pypi.org/simple; fi; \
    python3 -m venv /opt/venv; \
    pip install --find-links /opt/image-extras --index-url "$index" "torch==${TORCH_VERSION}"

FROM base AS app
ARG DEVICE=cpu
ARG TORCH_VERSION=2.13.0
COPY --from=torch /opt/venv /opt/venv
# README.md is always there, so the pattern never matches nothing; ca.crt only where needed.
COPY .ci/image-extras/README.md .ci/image-extras/*.crt /opt/image-extras/
COPY pyproject.toml README.md /src/
COPY shared /src/shared
COPY services /src/services
# torch is already there and satisfies the project's requirement: pip keeps it.
RUN set -e; \
    if [ -s /opt/image-extras/ca.crt ]; then export PIP_CERT=/opt/image-extras/ca.crt; fi; \
    pip install /src; \
    python -c "import torch, services.cli; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__"; \
    rm -rf /opt/image-extras; \
    groupadd --gid 10001 swarm; \
    useradd --create-home --uid 10001 --gid 10001 swarm; \
    install -d -o swarm -g swarm /data
ENV SWARM_LOG_FORMAT=json \
    SWARM_HOST=0.0.0.0 \
    SWARM_DEVICE=${DEVICE}
USER 10001:10001
WORKDIR /data
EXPOSE 8000 8100
CMD ["swarm", "--help"]
