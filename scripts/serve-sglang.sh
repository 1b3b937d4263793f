#!/usr/bin/env bash
# Serve the base model and the trainer's LoRA adapters with SGLang, for `generation.backend: server` with
# `generation.adapter_api: sglang` (adapters load at /load_lora_adapter; requests name `MODEL:<adapter>`).
#
# Run on the GPU box, in SGLang's own virtual environment (it pins its own torch). The trainer publishes
# adapters under ADAPTER_DIR/<agent>/v<step>/ and sends their paths: they must be readable here (the same
# machine, or shared storage mounted at generation.server_adapter_dir).
#
#   scripts/serve-sglang.sh MODEL [PORT]
#   then: mappa train CONFIG --set model.name=MODEL --set generation.backend=server \
#           --set generation.adapter_api=sglang --set generation.base_url=http://HOST:30000/v1
#
# Settings (environment): VENV (default ~/.venvs/sglang), SGLANG_VERSION (0.5.23), MAX_LORA_RANK (16),
# AGENTS (3), CONTEXT_LENGTH (8192), MEM_FRACTION (0.85), TENSOR_PARALLEL (1), SGLANG_API_KEY (passed as
# --api-key: every request then needs it as a Bearer token; train with
# --set generation.api_key_env=SGLANG_API_KEY so the trainer sends it).
set -euo pipefail

MODEL=${1:?usage: scripts/serve-sglang.sh MODEL [PORT]}
PORT=${2:-30000}
VENV=${VENV:-$HOME/.venvs/sglang}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
MAX_LORA_RANK=${MAX_LORA_RANK:-16}
AGENTS=${AGENTS:-3}
CONTEXT_LENGTH=${CONTEXT_LENGTH:-8192}
MEM_FRACTION=${MEM_FRACTION:-0.85}
TENSOR_PARALLEL=${TENSOR_PARALLEL:-1}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import sglang" 2>/dev/null; then
  echo "installing sglang[all]==$SGLANG_VERSION into $VENV (its own environment)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "sglang[all]==$SGLANG_VERSION"
fi

# No adapters at start: the trainer loads each agent's first version itself, so the LoRA shapes (rank,
# target modules) are declared up front. --max-loaded-loras leaves room for two versions per agent.
exec "$VENV/bin/python" -m sglang.launch_server \
  --model-path "$MODEL" \
  --port "$PORT" \
  --dtype bfloat16 \
  --enable-lora \
  --max-lora-rank "$MAX_LORA_RANK" \
  --lora-target-modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj \
  --max-loras-per-batch "$AGENTS" \
  --max-loaded-loras "$((2 * AGENTS))" \
  --context-length "$CONTEXT_LENGTH" \
  --mem-fraction-static "$MEM_FRACTION" \
  --tp-size "$TENSOR_PARALLEL" \
  ${SGLANG_API_KEY:+--api-key "$SGLANG_API_KEY"}
