# v4serve daemon image, two targets:
#   docker build -t v4serve:gpu .                  GPU nodes (the default, last stage): CUDA runtime,
#                                                  a CUDA build of torch and Triton
#   docker build --target cpu -t v4serve:cpu .     laptops and CI: CPU torch, no Triton
# podman and buildah keep the HEALTHCHECK only in Docker's image format: add `--format docker`.
# Run: docker run --gpus all -p 8000:8000 -v /data/DeepSeek-V4-Flash:/models:ro \
#        -v /data/v4serve-cache:/var/cache/v4serve v4serve:gpu --model /models
# Arguments after the image name are `v4serve serve` flags.

# ---- the package as a wheel (no torch needed to build it) ----------------------------------------
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server server
COPY engine engine
COPY cache cache
COPY kernels kernels
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- CPU target -----------------------------------------------------------------------------------
FROM python:3.11-slim AS cpu
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# torch first, in a layer of its own: a rebuild after a code change reuses it.
RUN pip install --no-cache-dir ${TORCH_SPEC}
RUN groupadd --system --gid 10001 v4serve \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/v4serve v4serve \
    && mkdir -p /models /var/cache/v4serve && chown v4serve:v4serve /var/cache/v4serve
COPY --from=wheel /wheels /wheels
# v4serve and its dependencies but Triton (~1 GB, required on Linux x86_64 for the GPU kernels): a CPU
# runs the plain torch kernels and never imports it.
RUN pip install --no-cache-dir --no-deps /wheels/*.whl \
    && python -c "import re; from importlib.metadata import requires; print(*(r for r in requires('v4serve') \
        if re.split('[^A-Za-z0-9._-]', r)[0] != 'triton'), sep=chr(10))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm -rf /wheels /tmp/requirements.txt
ENV V4SERVE_KV_STORE_DIR=/var/cache/v4serve \
    V4SERVE_SHUTDOWN_TIMEOUT=30 \
    PYTHONUNBUFFERED=1
VOLUME ["/models", "/var/cache/v4serve"]
USER v4serve
WORKDIR /home/v4serve
EXPOSE 8000
# Loading a large checkpoint takes minutes: failures during the start period do not count.
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# SIGTERM starts the graceful shutdown: running requests get V4SERVE_SHUTDOWN_TIMEOUT seconds, so
# give `docker stop` (and compose's stop_grace_period) more than that: 45 s.
STOPSIGNAL SIGTERM
ENTRYPOINT ["v4serve", "serve"]

# ---- GPU target (default) -------------------------------------------------------------------------
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS gpu
# Triton comes with torch: each CUDA build of torch pins the Triton it was built with (and pip finds
# it on the same index), so no Triton is named here.
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Triton compiles its kernels at first use with the C compiler and Python headers installed above.
RUN pip install --no-cache-dir ${TORCH_SPEC}
RUN groupadd --system --gid 10001 v4serve \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/v4serve v4serve \
    && mkdir -p /models /var/cache/v4serve && chown v4serve:v4serve /var/cache/v4serve
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl \
    && rm -rf /wheels
ENV V4SERVE_KV_STORE_DIR=/var/cache/v4serve \
    V4SERVE_SHUTDOWN_TIMEOUT=30 \
    PYTHONUNBUFFERED=1 \
    TRITON_CACHE_DIR=/var/cache/v4serve/triton
VOLUME ["/models", "/var/cache/v4serve"]
USER v4serve
WORKDIR /home/v4serve
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["v4serve", "serve"]
