#!/usr/bin/env bash
# Make the SmolLM2-135M-Instruct files that benchmarks/peer_smollm2.py compares, all from the
# same float values (the published Q4_1 GGUF dequantized by transformers):
#
#   OUT/hf-f32/              float32 Hugging Face folder (transformers' gguf_file loader; the
#                            recipe of shared/models/smollm2-135m-instruct/README.md)
#   OUT/smollm2-f32.gguf     llama.cpp's convert_hf_to_gguf.py --outtype f32 of that folder
#   OUT/smollm2-q8_0.gguf    llama-quantize ... Q8_0
#   OUT/smollm2-q4_0.gguf    llama-quantize ... Q4_0
#   OUT/smollm2-q4_1.gguf    a copy of the published Q4_1 file (served by both as it is)
#   OUT/nybble-int8-g32/     nybble quantize --method rtn --bits 8 --group-size 32 --sym
#   OUT/nybble-int4-g32/     nybble quantize --method rtn --bits 4 --group-size 32 --sym
#                            (symmetric, one scale per 32 inputs: the form of Q4_0 / Q8_0)
#   OUT/nybble-int4-g32-head/ the same with --quantize-lm-head (an INT8 g32 output head, as
#                            the Q8_0 token_embd llama-quantize writes for a tied model)
#   OUT/MANIFEST.txt         size and sha256 of every file made
#
# The converter runs in its own virtualenv (VENV, created if missing, with torch, gguf,
# transformers and accelerate) and the gguf-py of its own source tree; nybble quantize runs with $PYTHON (default:
# the python on PATH, which must import this checkout's nybble). Files that exist are kept
# (--force remakes them). How to get and build llama.cpp: benchmarks/README.md.
#
# Usage:
#   bash benchmarks/smollm2_artifacts.sh [--shared DIR] [--llama-dir DIR] [--build DIR]
#        [--out DIR] [--float-dir DIR] [--venv DIR] [--force]
# Defaults: --shared ../shared (beside the checkout), --llama-dir /work/scratch/llama.cpp,
#   --build /work/scratch/build, --out /work/scratch/smollm2, --float-dir OUT/hf-f32,
#   --venv /work/scratch/convvenv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHARED="$ROOT/../shared"
LLAMA_DIR=/work/scratch/llama.cpp
BUILD=/work/scratch/build
OUT=/work/scratch/smollm2
FLOAT_DIR=""
VENV=/work/scratch/convvenv
FORCE=0
PYTHON="${PYTHON:-python}"

while [ $# -gt 0 ]; do
  case "$1" in
    --shared) SHARED="$2"; shift 2 ;;
    --llama-dir) LLAMA_DIR="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --float-dir) FLOAT_DIR="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (allowed: --shared --llama-dir --build --out --float-dir --venv --force)" >&2
       exit 2 ;;
  esac
done
FLOAT_DIR="${FLOAT_DIR:-$OUT/hf-f32}"
GGUF_SRC="$SHARED/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
QUANTIZE="$BUILD/bin/llama-quantize"
for need in "$GGUF_SRC" "$LLAMA_DIR/convert_hf_to_gguf.py" "$QUANTIZE"; do
  [ -e "$need" ] || { echo "missing $need (see benchmarks/README.md, "Building the peer")" >&2; exit 1; }
done
mkdir -p "$OUT"

todo() {  # todo PATH: true when PATH must be (re)made
  [ "$FORCE" = 1 ] || [ ! -e "$1" ]
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "== virtualenv for the converter: $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0 gguf sentencepiece transformers numpy safetensors protobuf accelerate
fi

if todo "$FLOAT_DIR/config.json"; then
  echo "== float32 folder: $FLOAT_DIR"
  "$VENV/bin/python" - "$GGUF_SRC" "$FLOAT_DIR" <<'EOF'
import os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
src, out = sys.argv[1], sys.argv[2]
folder, name = os.path.dirname(src), os.path.basename(src)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
cfg = m.config
del cfg.quantization_config            # save_pretrained refuses a "gguf-quantized" model
fresh = LlamaForCausalLM(cfg)
fresh.load_state_dict(m.state_dict())
fresh.save_pretrained(out)
tok.save_pretrained(out)
EOF
fi

F32_GGUF="$OUT/smollm2-f32.gguf"
if todo "$F32_GGUF"; then
  echo "== F32 GGUF: $F32_GGUF"
  # NO_LOCAL_GGUF unset: the converter imports the gguf-py beside it, not the PyPI module.
  env -u NO_LOCAL_GGUF "$VENV/bin/python" "$LLAMA_DIR/convert_hf_to_gguf.py" "$FLOAT_DIR" \
    --outtype f32 --model-name SmolLM2-135M-Instruct --outfile "$F32_GGUF" \
    > "$OUT/convert.log" 2>&1 \
    || { tail -20 "$OUT/convert.log" >&2; exit 1; }
fi

for q in Q8_0 Q4_0; do
  lower="$(echo "$q" | tr 'A-Z' 'a-z')"
  dst="$OUT/smollm2-$lower.gguf"
  if todo "$dst"; then
    echo "== $q GGUF: $dst"
    "$QUANTIZE" "$F32_GGUF" "$dst" "$q" > "$OUT/quantize-$lower.log" 2>&1 \
      || { tail -20 "$OUT/quantize-$lower.log" >&2; exit 1; }
  fi
done

if todo "$OUT/smollm2-q4_1.gguf"; then
  cp "$GGUF_SRC" "$OUT/smollm2-q4_1.gguf"
fi

for variant in 8 4 4-head; do
  bits="${variant%-head}"
  dst="$OUT/nybble-int$variant-g32"
  [ "$variant" = 4-head ] && dst="$OUT/nybble-int4-g32-head"
  extra=""
  [ "$variant" = 4-head ] && extra="--quantize-lm-head"
  if todo "$dst/config.json"; then
    echo "== nybble INT$variant g32: $dst"
    rm -rf "$dst"
    (cd "$ROOT" && OMP_NUM_THREADS=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
       "$PYTHON" -m nybble quantize "$FLOAT_DIR" --method rtn --bits "$bits" --group-size 32 \
       --sym $extra --out "$dst" > "$OUT/nybble-int$variant.log" 2>&1) \
      || { tail -20 "$OUT/nybble-int$variant.log" >&2; exit 1; }
  fi
done

echo "== manifest: $OUT/MANIFEST.txt"
{
  echo "# made by benchmarks/smollm2_artifacts.sh from $GGUF_SRC"
  echo "# llama.cpp: $LLAMA_DIR, $("$BUILD/bin/llama-server" --version 2>&1 | grep -m1 version || true)"
  for f in "$FLOAT_DIR/model.safetensors" "$F32_GGUF" "$OUT"/smollm2-q8_0.gguf \
           "$OUT"/smollm2-q4_0.gguf "$OUT"/smollm2-q4_1.gguf "$OUT"/nybble-int8-g32/model.safetensors \
           "$OUT"/nybble-int4-g32/model.safetensors "$OUT"/nybble-int4-g32-head/model.safetensors; do
    printf '%s  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)" "$f"
  done
} > "$OUT/MANIFEST.txt"
cat "$OUT/MANIFEST.txt"
