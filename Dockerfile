# One image for every swarm-mesh service: `swarm server`, `swarm train`, `swarm up`.
#
#   docker build -t swarm-mesh:0.1.0 .
#
# PyPI's Linux torch wheel bundles the CUDA runtime, so this image also runs on a GPU
# (NVIDIA container toolkit, SWARM_DEVICE=cuda). For a smaller CPU-only image, pass
# PyTorch's CPU wheel index: docker build --build-arg TORCH_INDEX_URL=<that index> .
# BASE_IMAGE may name another base (a CUDA one, say) provided it has python >= 3.10 and pip.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, in its own layer: it is by far the largest and changes least often.
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"

WORKDIR /app
COPY . .
RUN pip install . \
    && useradd --create-home --uid 10001 swarm
USER 10001

EXPOSE 8100
CMD ["swarm", "--help"]
