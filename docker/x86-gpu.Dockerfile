# dsedge on an x86 NVIDIA GPU (T4, A100, H100/H200): NVIDIA's TensorRT container brings CUDA, cuDNN, TensorRT and its
# Python bindings; dsedge[gpu] adds onnxruntime-gpu (never the CPU wheel), cuda-python and nvidia-ml-py.
# Build from the repository root:  docker build -f docker/x86-gpu.Dockerfile -t dsedge:gpu .
# Run:  docker run --gpus all --rm -v "$PWD/out:/bundles" dsedge:gpu dsedge verify /bundles/NAME-a100.dse
# 24.08 = TensorRT 10.3, CUDA 12.6, Python 3.10 (see docs/jetpack.md for the x86/Jetson version table).
ARG TRT_CONTAINER=24.08
FROM nvcr.io/nvidia/tensorrt:${TRT_CONTAINER}-py3

ARG ORT_GPU_VERSION=1.20.1
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DSEDGE_ENGINE_CACHE=/var/cache/dsedge/engines

WORKDIR /opt/dsedge
COPY pyproject.toml README.md ./
COPY sdk ./sdk
COPY runtime ./runtime
COPY toolchain ./toolchain
COPY targets ./targets
RUN python3 -m pip install --no-cache-dir "onnxruntime-gpu==${ORT_GPU_VERSION}" ".[gpu,sign]" \
    && python3 -c "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()" \
    && mkdir -p /var/cache/dsedge/engines

VOLUME ["/var/cache/dsedge/engines"]
WORKDIR /bundles
CMD ["dsedge", "doctor"]
