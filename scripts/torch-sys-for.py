"""Makes tch's C++ wrappers (torch-sys, generated from libtorch 2.13's operator list) compile
against an older libtorch's headers, for scripts/gpu-bundle.sh:

    python3 scripts/torch-sys-for.py TORCH_SYS_SRC LIBTORCH_INCLUDE OUT_DIR

Copies the torch-sys crate TORCH_SYS_SRC to OUT_DIR and, in libtch/torch_api_generated.cpp,
replaces the body of every wrapper that calls an operator the older libtorch lacks (declared
nowhere in LIBTORCH_INCLUDE's ATen headers) with one that raises "not in this libtorch": such a wrapper is
still defined, so tch links as it is, and calling it is an error like any libtorch error. Also
those whose operator exists with another signature (CHANGED, found by compiling against 2.11).
The runner calls none of them. Prints the operators it stubbed.
"""

import os
import re
import shutil
import sys

# Operators whose signature changed between 2.11 and 2.13 (found by compiling the wrappers).
CHANGED = {"_scaled_dot_product_attention_math_for_mps"}


def declared_functions(include):
    """Every function name the ATen headers declare (`name(`), operators and their in-place and
    out variants alike."""
    names = set()
    for folder in (os.path.join(include, "ATen", "ops"), os.path.join(include, "ATen")):
        for file in os.listdir(folder):
            if file.endswith(".h"):
                with open(os.path.join(folder, file), errors="replace") as f:
                    names.update(re.findall(r"\b([a-z_]\w*)\(", f.read()))
    return names


def main():
    src, include, out = sys.argv[1:4]
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(src, out)
    declared = declared_functions(include)
    path = os.path.join(out, "libtch", "torch_api_generated.cpp")
    text = open(path).read()
    # One wrapper: its signature line, then `PROTECT(` ... `)` and `}` at the start of a line.
    wrapper = re.compile(r"^(void|tensor|int64_t|double|int) (atg_\w+)\((.*?)\) \{\n  PROTECT\(\n(.*?)\n  \)\n(.*?)^\}", re.M | re.S)
    stubbed = []

    def stub(m):
        calls = re.findall(r"torch::([a-z_]\w*)\(", m.group(4))
        missing = [op for op in calls if op in CHANGED or op not in declared]
        if not missing:
            return m.group(0)
        stubbed.append(missing[0])
        body = f'    throw std::runtime_error("{missing[0]}: not in this libtorch ({m.group(2)})");'
        return f"{m.group(1)} {m.group(2)}({m.group(3)}) {{\n  PROTECT(\n{body}\n  )\n{m.group(5)}}}"

    text = wrapper.sub(stub, text)
    with open(path, "w") as f:
        f.write(text)
    print(" ".join(sorted(set(stubbed))))


if __name__ == "__main__":
    main()
