#!/usr/bin/env bash
# Stage TorchRec's Triton TBE for `bench.cli --compare torchrec_triton --torchrec-checkout .stage/torchrec`:
# its three files into .stage/torchrec/torchrec/distributed/triton_tbe/ (git-ignored; never tracked here).
#   tools/stage_torchrec_triton.sh              from the read-only mirror ($TORCHREC_MIRROR), at $REV (HEAD)
#   tools/stage_torchrec_triton.sh PATH         from a TorchRec checkout: a work tree, or a git repo (at $REV)
# Writes .stage/torchrec/SOURCE (where from, which commit); the bench records it with the files' sha256.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:-${TORCHREC_MIRROR:-/work/.mirror/meta-pytorch+torchrec/repo}}
REV=${REV:-HEAD}
DIR=torchrec/distributed/triton_tbe
FILES=(triton_table_batched_embeddings.py triton_tbe_backward_utils.py triton_tbe_backward_long_run_fused.py)
DEST=.stage/torchrec
if [ -n "${1:-}" ] && [ -f "$SRC/$DIR/${FILES[0]}" ]; then
  mode=tree
elif git -C "$SRC" rev-parse --git-dir > /dev/null 2>&1; then
  mode=git
else
  echo "$SRC: no $DIR/${FILES[0]} and not a git repository" >&2; exit 1
fi
rm -rf "$DEST"
mkdir -p "$DEST/$DIR"
if [ $mode = git ]; then
  for f in "${FILES[@]}"; do git -C "$SRC" show "$REV:$DIR/$f" > "$DEST/$DIR/$f"; done
  echo "$SRC @ $(git -C "$SRC" rev-parse "$REV") ($(git -C "$SRC" log -1 --format=%cs "$REV"))" > "$DEST/SOURCE"
else
  for f in "${FILES[@]}"; do cp "$SRC/$DIR/$f" "$DEST/$DIR/"; done
  rev=$(git -C "$SRC" rev-parse HEAD 2> /dev/null || echo "no git")
  dirty=$(git -C "$SRC" status --porcelain -- "$DIR" 2> /dev/null | head -1 || true)
  echo "$SRC (work tree) @ $rev${dirty:+ (modified)}" > "$DEST/SOURCE"
fi
echo "staged $(cat "$DEST/SOURCE") -> $DEST/$DIR"
ls -l "$DEST/$DIR"
