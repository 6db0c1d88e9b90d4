#!/usr/bin/env python3
"""Checks that the memory-bound EP and permute kernels keep several 16-byte loads in flight per lane.

Their speed rests on each lane issuing a group of global loads before it uses any of them. Whether the
compiler keeps that shape depends on code around the loop: a change that left registers and spills as
they were (`-Xptxas -v` showed nothing) once made the bf16 combine issue two loads, repack them, then
issue the other two, and the combine took 16% longer. This reads the SASS of the compiled objects
(cuobjdump) and, for each rule, finds the largest group of plain 8- or 16-byte global loads that a kernel
issues before one of their registers is read or a branch intervenes; it fails where that group is
smaller than the rule's minimum. A group ends at any branch, even a forward one around a guarded load,
so the rules name kernels whose hot loop has no branch between its loads.

A rule may also bound the kernel's spill stores (STL). A second code path added to the overlapped
combine kernel once raised them from 4 to 87 at the same register cap, with the loads still grouped,
and the combine took 1.25x as long; a kernel of its own for the new path left the old one as it was.

usage: check_sass_loads.py [--cuobjdump PATH] OBJECT_OR_DIRECTORY... -- RULE...
  (a directory is searched for the objects the rules name)
  RULE  OBJECT_BASENAME:KERNEL_NAME_PART[,PART...]:MIN[:MAX_STL]  (every matching kernel of that object
        must reach MIN and hold at most MAX_STL local stores; a rule that matches no kernel fails, so a
        renamed kernel does not pass by accident)
Exit status: 0 all rules hold, 1 a rule fails, 77 no cuobjdump or nvdisasm (skipped, with the reason).
"""
import importlib.util
import os
import re
import shutil
import subprocess
import sys

# Plain (weak) loads: the sums' ld.global.cg of window data and the counters' acquires are .STRONG.
_LOAD = re.compile(r"\bLDG\.E\.(64|128)(?:\.CONSTANT)?\s+R(\d+)")
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def find_tool(name, explicit=None):
    """The CUDA tool `name`: explicit, on PATH, in /usr/local/cuda/bin, or from its PyPI wheel
    (nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm put it under nvidia/cu*/bin)."""
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which(name)
    if found:
        return found
    p = os.path.join("/usr/local/cuda/bin", name)
    if os.access(p, os.X_OK):
        return p
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in sorted(os.listdir(root)):
            p = os.path.join(root, sub, "bin", name)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                return p
    return None


def kernels(sass):
    """(mangled name, [instruction text]) per function of a cuobjdump -sass listing."""
    out = []
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        out.append((name, [m.group(2) for m in _INSN.finditer(chunk)]))
    return out


def load_groups(insns):
    """Sizes of the groups of 8/16-byte global loads issued before one of their results is read."""
    groups, i = [], 0
    while i < len(insns):
        if not _LOAD.search(insns[i]):
            i += 1
            continue
        dst, n = set(), 0
        while i < len(insns):
            t = insns[i]
            m = _LOAD.search(t)
            if m:
                width = 2 if m.group(1) == "64" else 4
                dst |= set(range(int(m.group(2)), int(m.group(2)) + width))
                n += 1
                i += 1
                continue
            operands = t.split(",", 1)[1] if "," in t else ""
            if "BRA" in t or "EXIT" in t or dst & {int(r) for r in re.findall(r"\bR(\d+)", operands)}:
                break
            i += 1
        groups.append(n)
    return groups


def main(argv):
    cuobjdump = None
    if argv[:1] == ["--cuobjdump"]:
        cuobjdump, argv = argv[1], argv[2:]
    if "--" not in argv:
        print(__doc__)
        return 2
    cut = argv.index("--")
    objects, rules = argv[:cut], argv[cut + 1:]
    tool, disasm = find_tool("cuobjdump", cuobjdump), find_tool("nvdisasm")
    if tool is None or disasm is None:
        print("check_sass_loads: SKIPPED: no cuobjdump / nvdisasm (the CUDA toolkit's, or "
              "`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`)")
        return 77
    # cuobjdump -sass runs nvdisasm, which it looks for on PATH.
    env = dict(os.environ, PATH=os.path.dirname(disasm) + os.pathsep + os.environ.get("PATH", ""))
    by_base = {}
    for path in objects:
        if os.path.isdir(path):
            for root, _, files in sorted(os.walk(path)):
                for f in sorted(files):
                    by_base.setdefault(f, os.path.join(root, f))
        else:
            by_base.setdefault(os.path.basename(path), path)
    listings = {}
    failed = 0
    for rule in rules:
        try:
            fields = rule.split(":")
            if len(fields) not in (3, 4):
                raise ValueError(rule)
            base, parts, minimum = fields[0], fields[1].split(","), int(fields[2])
            max_stl = int(fields[3]) if len(fields) == 4 else None
        except ValueError:
            print(f"FAIL {rule}: not OBJECT_BASENAME:KERNEL_NAME_PART[,PART...]:MIN[:MAX_STL]")
            failed += 1
            continue
        obj = by_base.get(base)
        if obj is None:
            print(f"FAIL {rule}: no object named {base} in {' '.join(objects)}")
            failed += 1
            continue
        if obj not in listings:
            listings[obj] = kernels(subprocess.run([tool, "-sass", obj], check=True, capture_output=True, text=True,
                                                    env=env).stdout)
        matched = [(n, ins) for n, ins in listings[obj] if all(p in n for p in parts)]
        if not matched:
            print(f"FAIL {rule}: no kernel of {base} has {parts} in its name")
            failed += 1
            continue
        for name, ins in matched:
            groups = load_groups(ins)
            best = max(groups, default=0)
            spills = sum(1 for t in ins if re.match(r"(@!?U?P\w+\s+)?STL\b", t))
            ok = best >= minimum and (max_stl is None or spills <= max_stl)
            failed += not ok
            bound = "" if max_stl is None else f"; {spills} spill stores (at most {max_stl})"
            print(f"{'ok  ' if ok else 'FAIL'} {base} {name[:110]}: largest load group {best} (needs {minimum}){bound}; "
                  f"groups {groups[:12]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
