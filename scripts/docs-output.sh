#!/usr/bin/env bash
# Rewrites every printed output of README.md and docs/ from the current binary: each ```console
# block's output after its `$` lines, and the stored snapshots of the long runs
# (tests/docs-output/NAME.txt) that `cargo test --test integration docs_output::` checks the pages against.
# A block's `...` elisions are kept where what they stand between is still found.
#
#   scripts/docs-output.sh            # release build (the timings the pages show), every block
#   scripts/docs-output.sh --debug    # debug build: faster to build, slower to run
#   scripts/docs-output.sh [--debug] docs/guide/language-models.md   # only the pages whose path holds this
#
# Then review `git diff README.md docs tests/docs-output` and commit. See docs/development.md.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=(--release)
if [[ "${1:-}" == "--debug" ]]; then
    profile=()
    shift
fi
export DOCS_PAGE="${1:-}"
export LIBTORCH="${LIBTORCH:-$PWD/.deps/libtorch}"
SNAPSHOTS=overwrite DOCS_OUTPUT=all cargo test "${profile[@]}" --test integration docs_output:: -- --nocapture
