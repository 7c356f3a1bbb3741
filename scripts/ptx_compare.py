#!/usr/bin/env python3
"""Kernel-by-kernel PTX comparison of the CUDA plugin between a commit and the working tree.

A change to plugins/cuda that should not change what the GPU runs (a helper shared by two
kernels, a kernel generalised with a template parameter, a comment) can be checked here without a
GPU: each file is compiled to PTX at REV (plugins/cuda and include from `git archive`) and as it is
now, with the plugin's nvcc flags (plugins/cuda/CMakeLists.txt), and each kernel's PTX is compared
after normalising what does not change the code:
  - the per-file hashes nvcc puts in internal names (_GLOBAL__N__<hash>_..., _INTERNAL_<hash>_...),
  - label numbers ($L__BB<k>_<n>), and the kernel's own mangled name inside its body (parameter
    and function-scope shared variable names).
A kernel whose mangled name changed (a template parameter or a kernel parameter added) is paired
with --rename OLD=NEW, substrings replaced in the REV side's names; an added trailing kernel
parameter that the kernel never reads leaves the code identical: such kernels are counted apart.

    scripts/ptx_compare.py [--base REV] [--rename OLD=NEW ...] [--show N] [--nvcc PATH] FILE.cu ...

FILE.cu are paths such as plugins/cuda/gemm.cu. Prints, per file, the identical kernels (and those
identical but for their parameter list), the changed, added and removed ones, and for a changed
kernel its first N differing lines (default 12). Exit status 0 when no kernel of REV changed code,
none was removed and none added; 1 otherwise; 2 when a compilation failed.
"""
import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

NVCC_FLAGS = ["-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr", "-ptx"]


def find_nvcc(given):
    for candidate in (given, shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.exists(candidate):
            return candidate
    sys.exit("ptx_compare: nvcc not found (put it on PATH or pass --nvcc)")


def extract_base(rev, into):
    """plugins/cuda and include at REV, unpacked under `into`."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "plugins/cuda", "include"],
                             check=True, capture_output=True).stdout
    tar_path = os.path.join(into, "base.tar")
    with open(tar_path, "wb") as f:
        f.write(archive)
    with tarfile.open(tar_path) as t:
        t.extractall(into)


def compile_ptx(nvcc, root, source):
    """The PTX text of root/source, or None (with the compiler's message on stderr)."""
    out = tempfile.NamedTemporaryFile(suffix=".ptx", delete=False).name
    cmd = [nvcc, *NVCC_FLAGS, "-I", os.path.join(root, "include"), "-I", os.path.join(root, "plugins/cuda"),
           os.path.join(root, source), "-o", out]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(f"ptx_compare: {' '.join(cmd)} failed:\n{result.stderr}\n")
        return None
    with open(out) as f:
        text = f.read()
    os.unlink(out)
    return text


def kernels(ptx):
    """{mangled kernel name: normalised body} of one PTX file."""
    ptx = re.sub(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+", "ANON", ptx)
    ptx = re.sub(r"_INTERNAL_[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+", "INTERNAL", ptx)
    found = {}
    for m in re.finditer(r"\.entry (\S+)\((.*?)\n\}\n", ptx, re.S):
        name, body = m.group(1), m.group(0)
        body = body.replace(name, "KERNEL")
        body = re.sub(r"_ZZN5xcuda\d+ANON\S*?E(\d+\w+)", r"LOCAL_\1", body)  # function-scope statics
        body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
        found[name] = body
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="plugins/cuda/*.cu paths")
    ap.add_argument("--base", default="HEAD", help="the commit to compare against (default HEAD)")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="replace OLD by NEW in the base side's kernel names before pairing")
    ap.add_argument("--show", type=int, default=12, help="differing lines shown per changed kernel")
    ap.add_argument("--nvcc", help="the nvcc to use (default: PATH, then /usr/local/cuda/bin)")
    args = ap.parse_args()
    nvcc = find_nvcc(args.nvcc)
    renames = [r.split("=", 1) for r in args.rename]
    if any(len(r) != 2 for r in renames):
        sys.exit("ptx_compare: --rename takes OLD=NEW")
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True, capture_output=True,
                          text=True).stdout.strip()
    status = 0
    with tempfile.TemporaryDirectory() as base_dir:
        extract_base(args.base, base_dir)
        for source in args.files:
            rel = os.path.relpath(os.path.abspath(source), root)
            old_ptx, new_ptx = compile_ptx(nvcc, base_dir, rel), compile_ptx(nvcc, root, rel)
            if old_ptx is None or new_ptx is None:
                return 2
            old, new = kernels(old_ptx), kernels(new_ptx)
            for a, b in renames:
                old = {name.replace(a, b): body.replace(a, b) for name, body in old.items()}
            same, params_only, changed = [], [], {}
            for k in (k for k in old if k in new):
                diff = [line for line in difflib.unified_diff(old[k].splitlines(), new[k].splitlines(),
                                                              lineterm="", n=0)
                        if not line.startswith(("---", "+++", "@@"))]
                if not diff:
                    same.append(k)
                elif all(re.match(r"[-+]\s*\.param ", line) for line in diff):
                    params_only.append(k)  # a kernel parameter added or resized, the code unchanged
                else:
                    changed[k] = diff
            removed = [k for k in old if k not in new]
            added = [k for k in new if k not in old]
            print(f"{rel}: {len(same)} identical, {len(params_only)} identical but for their parameter list, "
                  f"{len(changed)} changed, {len(added)} added, {len(removed)} removed (against {args.base})")
            for k, diff in changed.items():
                print(f"  changed {k}: {len(diff)} lines differ")
                for line in diff[:args.show]:
                    print(f"    {line}")
            for k in added:
                print(f"  added   {k}")
            for k in removed:
                print(f"  removed {k}")
            if changed or added or removed:
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
