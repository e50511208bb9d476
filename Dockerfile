# pdproxy container image: the proxy, the simulator and the bench in one package.
#   docker build -t pdproxy:0.1.0 .
# Not built in this repository's CI (no Docker engine there); linted with hadolint.
FROM python:3.11.14-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md setup.py MANIFEST.in ./
COPY _build ./_build
COPY pdproxy ./pdproxy
# pure Python: the slim image has no C compiler for PDPROXY_COMPILE=1 (README, "Compiled hot path")
RUN pip install --no-cache-dir . \
 && useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin pdproxy

USER 10001
EXPOSE 8000
ENTRYPOINT ["pdproxy"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
