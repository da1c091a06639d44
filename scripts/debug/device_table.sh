# Sourced by the debug scripts that tune or A/B the device table on a GPU (scripts/debug/*.sh):
# runs from the repository root with the source tree and scripts/debug importable, prints the GPU
# and the time, and sets $table to this GPU's table under src/safemoe/configs/.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH=src:scripts/debug
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; date -u
table=$(ls src/safemoe/configs/NVIDIA_H*.json | grep -F "$(nvidia-smi --query-gpu=name --format=csv,noheader | tr ' ' _)")
