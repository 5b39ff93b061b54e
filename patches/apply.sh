#!/usr/bin/env bash
# Apply patches/pretrain_gpt.patch to a Megatron-LM checkout (branch core_r0.19.0).
#
#   patches/apply.sh MEGATRON_LM_DIR
#
# Checks that MEGATRON_LM_DIR holds pretrain_gpt.py and a Megatron-Core 0.19.x
# (megatron/core/package_info.py), then `git apply --check`s the patch before applying it.
# Idempotent: an already-patched pretrain_gpt.py is reported and left alone (exit 0).
# Exit status 1 when the file matches neither the unpatched nor the patched text.
#
# Environment:
#   GIFT_PATCH=FILE        the patch to apply (default: pretrain_gpt.patch next to this script)
#   GIFT_PATCH_FORCE=1     skip the Megatron-Core version check (other versions: at your own risk;
#                          the patch still has to apply cleanly)
set -euo pipefail

die() { echo "apply.sh: error: $*" >&2; exit 1; }

[[ $# -eq 1 ]] || { echo "usage: $0 MEGATRON_LM_DIR" >&2; exit 2; }
dir=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patch=${GIFT_PATCH:-$here/pretrain_gpt.patch}
patch=$(cd "$(dirname "$patch")" && pwd)/$(basename "$patch")

command -v git >/dev/null || die "git is needed (git apply)"
[[ -f $patch ]] || die "patch not found: $patch"
[[ -d $dir ]] || die "$dir is not a directory (expected a Megatron-LM checkout)"
[[ -f $dir/pretrain_gpt.py ]] || die "$dir/pretrain_gpt.py not found: is $dir a Megatron-LM checkout?"

if [[ ${GIFT_PATCH_FORCE:-0} != 1 ]]; then
    info=$dir/megatron/core/package_info.py
    [[ -f $info ]] || die "$info not found: is $dir a Megatron-LM checkout? (GIFT_PATCH_FORCE=1 skips this check)"
    major=$(sed -n 's/^MAJOR *= *\([0-9]*\).*/\1/p' "$info")
    minor=$(sed -n 's/^MINOR *= *\([0-9]*\).*/\1/p' "$info")
    if [[ "$major.$minor" != 0.19 ]]; then
        die "$dir has Megatron-Core ${major:-?}.${minor:-?}; the patch targets core_r0.19.0 (0.19.x):" \
            "git -C $dir checkout core_r0.19.0 (GIFT_PATCH_FORCE=1 skips this check)"
    fi
    if branch=$(git -C "$dir" rev-parse --abbrev-ref HEAD 2>/dev/null) && [[ $branch != core_r0.19.0 ]]; then
        echo "apply.sh: note: $dir is on '$branch', not core_r0.19.0 (Megatron-Core $major.$minor: continuing)" >&2
    fi
fi

cd "$dir"
# `git apply` inside a work tree resolves paths from its top level; --directory keeps them
# relative to MEGATRON_LM_DIR when that is a subfolder of some other repository.
prefix=()
if top=$(git rev-parse --show-toplevel 2>/dev/null); then
    rel=$(git rev-parse --show-prefix)
    [[ -n $rel ]] && prefix=(--directory="${rel%/}")
fi

if git apply "${prefix[@]}" --check "$patch" 2>/dev/null; then
    git apply "${prefix[@]}" "$patch"
    echo "apply.sh: patched $dir/pretrain_gpt.py (megatron-gift: --gift-* flags, gift_ddp around pretrain)"
elif git apply "${prefix[@]}" --reverse --check "$patch" 2>/dev/null; then
    echo "apply.sh: $dir/pretrain_gpt.py is already patched; nothing to do"
else
    echo "apply.sh: error: $patch does not apply to $dir/pretrain_gpt.py (git apply --check says):" >&2
    git apply "${prefix[@]}" --check "$patch" >&2 || true
    die "pretrain_gpt.py differs from core_r0.19.0's:" \
        "check out core_r0.19.0 (git -C $dir checkout core_r0.19.0 -- pretrain_gpt.py) and rerun"
fi
