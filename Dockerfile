# The ampscope exporter (`ampscope serve`), also able to run `ampscope demo`.
#
#   docker build -t ampscope .
#   docker run --rm -p 9478:9478 ampscope            # serve on 0.0.0.0:9478
#
# torch comes from PyTorch's CPU wheel index: the exporter never touches a GPU, and PyPI's
# default torch wheel pulls several GB of CUDA libraries. constraints/pins.txt pins the
# same versions CI tests; pip prefers the index's torch==X+cpu build over PyPI's X.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/ampscope
COPY pyproject.toml README.md ./
COPY constraints/ constraints/
COPY ampscope/ ampscope/
# ampscope/bundle/assets links to these: the wheel built here carries them for `ampscope export`.
COPY dashboards/ dashboards/
COPY deploy/ deploy/
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu \
        -c constraints/pins.txt ".[service]"

RUN useradd --create-home --uid 10001 ampscope
USER ampscope

EXPOSE 9478
ENTRYPOINT ["ampscope"]
CMD ["serve", "--host", "0.0.0.0", "--port", "9478"]
