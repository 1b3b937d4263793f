#!/usr/bin/env bash
# Serve the base model and the trainer's LoRA adapters with vLLM, for `generation.backend: server`.
#
# Run on the GPU box, in vLLM's own virtual environment (vLLM pins its own torch and transformers; it can
# never share mappa's). The trainer publishes adapters under ADAPTER_DIR/<agent>/v<step>/ and asks this
# server to load each one by path, so ADAPTER_DIR must be readable here under the path the trainer sends
# (the same machine, or shared storage mounted at generation.server_adapter_dir).
#
#   scripts/serve-vllm.sh MODEL [PORT]
#   e.g. scripts/serve-vllm.sh Qwen/Qwen3-4B 8000
#   then: mappa train configs/mathchat.yaml --set model.name=Qwen/Qwen3-4B --set generation.backend=server \
#           --set generation.base_url=http://HOST:8000/v1
#
# Settings (environment): VENV (default ~/.venvs/vllm), VLLM_VERSION (0.33.0), MAX_LORA_RANK (the
# run's model.lora_r or more; default 16), AGENTS (default 3), MAX_MODEL_LEN (generation.max_context_tokens
# + generation.max_new_tokens; default 8192), GPU_MEMORY_UTILIZATION (0.85), TENSOR_PARALLEL (1),
# SERVED_NAME (default MODEL: it must equal the trainer's model.name, which names the base in requests),
# VLLM_API_KEY (vLLM reads it itself: every request then needs it as a Bearer token; train with
# --set generation.api_key_env=VLLM_API_KEY so the trainer sends it). vLLM listens on every interface and
# loads any adapter path it is sent: set a key unless the port is firewalled.
set -euo pipefail

MODEL=${1:?usage: scripts/serve-vllm.sh MODEL [PORT]}
PORT=${2:-8000}
VENV=${VENV:-$HOME/.venvs/vllm}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
MAX_LORA_RANK=${MAX_LORA_RANK:-16}
AGENTS=${AGENTS:-3}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.85}
TENSOR_PARALLEL=${TENSOR_PARALLEL:-1}
SERVED_NAME=${SERVED_NAME:-$MODEL}

if [ ! -x "$VENV/bin/vllm" ]; then
  echo "installing vllm==$VLLM_VERSION into $VENV (its own environment)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm==$VLLM_VERSION"
fi

# Runtime adapter loading (POST /v1/load_lora_adapter) is off unless this is set.
export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True

# --logprobs-mode processed_logprobs: log-probs of the temperature-scaled distribution that was sampled from
# (what the PPO ratio and the KL refer to); keep generation.top_p at 1, since vLLM's processed values include it.
# --max-loras: adapters in one batch (every agent's turn can share a batch); --max-cpu-loras: adapters kept
# loaded, with room for the next step's versions next to the current ones while they are swapped.
exec "$VENV/bin/vllm" serve "$MODEL" \
  --served-model-name "$SERVED_NAME" \
  --port "$PORT" \
  --dtype bfloat16 \
  --enable-lora \
  --logprobs-mode processed_logprobs \
  --max-lora-rank "$MAX_LORA_RANK" \
  --max-loras "$AGENTS" \
  --max-cpu-loras "$((2 * AGENTS))" \
  --max-model-len "$MAX_MODEL_LEN" \
  --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION" \
  --tensor-parallel-size "$TENSOR_PARALLEL" \
  --enable-prefix-caching
