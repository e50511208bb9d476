# pdproxy container image: the proxy, the simulator and the bench in one package, with the hot path
# compiled (mypyc, README "Compiled hot path"), on the Python vLLM's images run.
#   docker build -t pdproxy:0.1.0 .
# Not built in this repository's CI (no Docker engine there): linted with hadolint, its build is the
# one .ci/run makes and tests (PDPROXY_COMPILE=1 pip wheel), and its final check runs there against
# that wheel (tests/test_deploy.py).

# The wheel, built where a C compiler and Python's headers are (the full image has both)
FROM python:3.12.12-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md setup.py MANIFEST.in ./
COPY _build ./_build
COPY pdproxy ./pdproxy
# 1: compiled, or the build fails (never a silent pure-Python image)
RUN PDPROXY_COMPILE=1 pip wheel --no-cache-dir --no-deps -w /wheels .

# Only the wheel (and its dependencies from PyPI) in the image that runs, no compiler, no source tree
FROM python:3.12.12-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/pdproxy-*.whl \
 && rm -rf /wheels \
 && python -c "from pdproxy import compiled; r = compiled.report(); assert r['form'] == 'compiled', r; print(compiled.summary(r))" \
 && useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin pdproxy

USER 10001
EXPOSE 8000
ENTRYPOINT ["pdproxy"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
