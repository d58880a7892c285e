# dsedge on Jetson (AGX Orin, Orin NX/Nano) with JetPack 6.x: the L4T JetPack base brings CUDA, cuDNN and TensorRT with
# its Python bindings for the system Python 3.10. The onnxruntime-gpu wheel for Jetson is not on PyPI: it comes from
# NVIDIA's Jetson AI Lab index for this JetPack/CUDA (ORT_INDEX). dsedge[jetson] pulls no ONNX Runtime of its own.
# Build on the Jetson (or with an arm64 builder) from the repository root:
#   docker build -f docker/jetson.Dockerfile -t dsedge:jetson .
# Run:  docker run --runtime nvidia --rm -v "$PWD/out:/bundles" dsedge:jetson dsedge verify /bundles/NAME-jetson-orin.dse
# r36.4.0 = JetPack 6.1 (TensorRT 10.3, CUDA 12.6); r36.3.0 = JetPack 6.0 (TensorRT 8.6, no INT4). See docs/jetpack.md.
ARG L4T_VERSION=r36.4.0
FROM nvcr.io/nvidia/l4t-jetpack:${L4T_VERSION}

ARG ORT_INDEX=https://pypi.jetson-ai-lab.dev/jp6/cu126
ARG ORT_GPU_VERSION=1.20.0
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DSEDGE_ENGINE_CACHE=/var/cache/dsedge/engines

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-pip=22.0.2+dfsg-1ubuntu0.5 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/dsedge
COPY pyproject.toml README.md ./
COPY sdk ./sdk
COPY runtime ./runtime
COPY toolchain ./toolchain
COPY targets ./targets
RUN python3 -m pip install --no-cache-dir --extra-index-url "${ORT_INDEX}" "onnxruntime-gpu==${ORT_GPU_VERSION}" \
    && python3 -m pip install --no-cache-dir ".[jetson,sign]" \
    && python3 -c "import tensorrt, onnxruntime as o; print(tensorrt.__version__, o.get_available_providers())" \
    && mkdir -p /var/cache/dsedge/engines

VOLUME ["/var/cache/dsedge/engines"]
WORKDIR /bundles
CMD ["dsedge", "doctor"]
