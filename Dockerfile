# v4serve daemon image. CPU wheel by default; for GPU nodes build with e.g.
#   docker build --build-arg TORCH_SPEC="torch==2.13.0 --index-url <CUDA wheel index>" -t v4serve .
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
WORKDIR /opt/v4serve
COPY pyproject.toml README.md ./
COPY server server
COPY engine engine
COPY cache cache
COPY kernels kernels
RUN pip install --no-cache-dir ${TORCH_SPEC} && pip install --no-cache-dir .

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
ENTRYPOINT ["v4serve", "serve", "--host", "0.0.0.0", "--port", "8000"]
