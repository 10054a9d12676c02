# vLLM engines with the rendezvous connector (rendezvous.connector.rendezvous_connector) and the NIXL data plane.
# Build from the repository root: docker build -f deploy/vllm.Dockerfile -t vllm-rendezvous:0.1.0 .
FROM vllm/vllm-openai:v0.11.0
WORKDIR /opt/kv-rendezvous
COPY pyproject.toml README.md ./
COPY rendezvous ./rendezvous
COPY clients ./clients
COPY connector ./connector
# The package itself, from source; its dependencies are bounded in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[nixl]"
USER 1000:1000
ENTRYPOINT []
