"""Compile every Triton kernel launch the CPU kernel tests make for the GPU, without a GPU.

The CPU suite runs the kernels in Triton's interpreter, which accepts code the GPU compiler
rejects; a device session that finds such an error has spent minutes on it. This records each
launch of the kernel tests (kernel, argument types, constexpr values, launch options) and
compiles every distinct one for a target (default Hopper, sm_90) with this machine's Triton —
which can differ from the device's version, so a pass here is a strong hint, not a proof. Each
launch is also compiled in the form a GPU runs it (the constexprs the interpreter is launched
with instead: inline PTX, hardware conversions, libdevice, the indexer's tensor-core products),
and checked against the shared memory the target lets a block have (`--arch 120`: the
reference box's RTX PRO 6000, 99 KiB).

    python scripts/compile_check.py [--arch 90] [--tests "tests/test_kernels_*.py …"] [--regs]
    python scripts/compile_check.py --nvrtc …/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 [--sass]
        (the CUDA C kernel; --sass: its k-loop's instruction counts)

Exit status 1 when any launch fails to compile or does not fit (each failure is printed).
"""
from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import subprocess
import sys
import tempfile

# (the recording side runs inside pytest: tests/conftest.py calls record_launches())
_TORCH_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64",
                "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8",
                "bool": "i1", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def record_launches(path: str) -> None:
    """Append a JSON line per interpreted kernel launch to `path` (set up once per process)."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        constexpr = {n for n, a in getattr(fn, "__annotations__", {}).items()
                     if "constexpr" in str(a)}
        values = dict(zip(self.arg_names, args))
        values.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        # A GPU launch specialises what it is given (Triton's JIT): a pointer or integer
        # divisible by 16 compiles as such (vector loads, cp.async, software pipelining: the
        # shared memory a kernel takes), an integer 1 as a constant — except do_not_specialize's
        fixed = {self.arg_names[a] if isinstance(a, int) else a
                 for a in self.kwargs.get("do_not_specialize") or ()}
        sig, consts, aligned = {}, {}, []
        for name in self.arg_names:
            v = values.get(name)
            if name in constexpr:
                # (a Triton dtype passed as a constexpr travels by its name)
                consts[name] = {"tl.dtype": v.name} if type(v).__module__.startswith(
                    "triton") else v
                sig[name] = "constexpr"
            elif isinstance(v, torch.Tensor):
                sig[name] = "*" + _TORCH_TYPES[str(v.dtype).removeprefix("torch.")]
                if name not in fixed and v.data_ptr() % 16 == 0:
                    aligned.append(name)
            elif isinstance(v, bool):
                sig[name] = "i1"
            elif isinstance(v, int) and v == 1 and name not in fixed:
                sig[name], consts[name] = "constexpr", 1
            elif isinstance(v, int):
                sig[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
                if name not in fixed and v % 16 == 0:
                    aligned.append(name)
            elif isinstance(v, float):
                sig[name] = "fp32"
            elif isinstance(v, TensorDescriptor):  # (a host TMA descriptor: dtype and block)
                sig[name] = mangle_type(v)
            else:
                raise TypeError(f"{fn.__name__}: argument {name} of type {type(v)}")
        opts = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
        with open(path, "a") as f:
            f.write(json.dumps({"module": fn.__module__, "name": fn.__name__, "sig": sig,
                                "constexprs": consts, "aligned": aligned,
                                "options": opts}) + "\n")
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def _resources(compiled) -> str:
    """Registers, spills and shared memory per thread block of a compiled kernel, read from its
    cubin with the cuobjdump Triton ships (what sets how many blocks an SM holds)."""
    import re
    import shutil
    from triton.backends.nvidia import __file__ as nv
    tool = os.path.join(os.path.dirname(nv), "bin", "cuobjdump")
    if not os.path.exists(tool):
        tool = shutil.which("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    dyn = compiled.metadata.shared
    return (f"{m.group(1)} registers, stack {m.group(2)}, shared {int(m.group(3)) + dyn} B"
            if m else out.strip()[-200:])


# Shared memory a thread block may opt into, by target (CUDA's per-architecture limits): what a
# launch past it fails with on such a GPU ("out of resources"), whatever this machine compiles.
SHARED_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448,
                120: 101376}

# Constexprs the interpreter is launched with but the GPU is not: each launch is also compiled
# in the form a GPU runs. (The row kernel's tensor-core products are not here: they change its
# tile shape too, which a recorded launch does not say.)
_GPU_SWITCHES = ("ASM", "ON_GPU", "LIBDEVICE")


def gpu_forms(name: str, sig: dict, consts: dict, arch: int = 90) -> list[tuple[dict, dict]]:
    """(signature, constexprs) of what a GPU of compute capability `arch` launches in place of
    a recorded interpreted launch — the launch itself first."""
    if "JOIN_B" in consts:  # (the EXL3 GEMM joins Ŵ where tl.dot is mma.sync: off sm_90,
        # where its operands come through pointers, not TMA's descriptors)
        consts = {**consts, "JOIN_B": arch != 90}
        if consts.get("TMA") and arch != 90:
            consts["TMA"] = False
            sig = {k: "*fp16" if str(v).startswith("tensordesc") else v for k, v in sig.items()}
    forms = [(sig, consts)]
    switched = {k: True for k in _GPU_SWITCHES if consts.get(k) is False}
    if switched:
        forms.append((sig, {**consts, **switched}))
    if name == "_rowwise_kernel" and consts.get("WIDEN") and consts.get("PRODUCT") in (3, 4):
        # (kernels/rowwise: the interpreter's fp32 FMA / widened planes stand for the GPU's
        # tensor-core products — 16-bit pairs, fp32 rows split in three, stored planes — at
        # their prefill tiles, tile_shape's)
        gpu = {**consts, "WIDEN": False, "BLOCK_M": 64, "BLOCK_K": 64}
        if consts["PRODUCT"] == 4:
            forms.append((sig, {**gpu, "BLOCK_N": 64}))
        else:
            forms.append(({**sig, "x_ptr": "*bf16", "w_ptr": "*bf16"},
                          {**gpu, "PRODUCT": 1, "BLOCK_N": 128}))
            forms.append(({**sig, "x_ptr": "*fp32", "w_ptr": "*bf16"},
                          {**gpu, "PRODUCT": 2, "BLOCK_N": 64}))
    if name == "_index_scores_kernel" and consts.get("PRODUCT") == 0:
        # (kernels/indexer.index_scores: 16-bit pairs on tensor cores; fp32 queries against
        # bf16 keys split in three bf16 products)
        if sig["q_ptr"] == sig["k_ptr"] and sig["q_ptr"] in ("*bf16", "*fp16"):
            forms.append((sig, {**consts, "PRODUCT": 1}))
        forms.append(({**sig, "q_ptr": "*fp32", "k_ptr": "*bf16"}, {**consts, "PRODUCT": 2}))
    return forms


def compile_all(path: str, arch: int, regs: bool = False, limit: int | None = None) -> int:
    """Compile each distinct recorded launch (no interpreter in this process) in each of its
    GPU forms; a form that fails to compile, or needs more shared memory than the target lets
    a block have (`limit`, bytes: SHARED_LIMIT's for the arch unless given), is a failure.
    `regs`: print each one's registers and shared memory."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    seen, failures, worst = set(), 0, {}
    limit = limit or SHARED_LIMIT.get(arch)
    with open(path) as f:
        launches = [json.loads(line) for line in f]
    for la in launches:
        kernel = getattr(importlib.import_module(la["module"]), la["name"])
        for sig, recorded in gpu_forms(la["name"], la["sig"], la["constexprs"], arch):
            consts = {k: tl.dtype(v["tl.dtype"]) if isinstance(v, dict) else v
                      for k, v in recorded.items()}
            forms = [(consts, la["options"])]
            if consts.get("PDL") is False:  # (interpreted without it; the GPU launches it so)
                forms.append(({**consts, "PDL": True}, {**la["options"], "launch_pdl": True}))
            for c, options in forms:
                key = json.dumps([la["module"], la["name"], sig, recorded, c.get("PDL"),
                                  options, la.get("aligned", [])], sort_keys=True)
                if key in seen:
                    continue
                seen.add(key)
                shown = {k: v for k, v in c.items() if not isinstance(v, tl.dtype)}
                names = list(sig)
                attrs = {(names.index(n),): [["tt.divisibility", 16]]
                         for n in la.get("aligned", ())}
                src = ASTSource(fn=kernel, signature=sig, constexprs=c, attrs=attrs)
                try:
                    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                              options=options)
                except Exception as e:  # (a compile error of any kind is what we look for)
                    failures += 1
                    print(f"FAILED {la['module']}.{la['name']} {shown}: {e}", flush=True)
                    continue
                shared = compiled.metadata.shared
                worst[la["name"]] = max(worst.get(la["name"], 0), shared)
                if limit is not None and shared > limit:
                    failures += 1
                    print(f"FAILED {la['module']}.{la['name']} {shown}: {shared} B of shared "
                          f"memory, more than a block may have ({limit} B)", flush=True)
                if regs:
                    print(f"{la['name']} {shown} {options}: {_resources(compiled)}", flush=True)
    top = sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    print("most shared memory: " + ", ".join(f"{n} {b} B" for n, b in top)
          + (f" (the limit: {limit} B)" if limit else ""))
    print(f"{len(seen)} distinct launches of {len({(la['module'], la['name']) for la in launches})}"
          f" kernels compiled for sm_{arch}: {failures} failed")
    return 1 if failures else 0


def _k_loop(cubin: str) -> tuple[list[str], int]:
    """The k-loop of exl3_mma's compiled kernel — the innermost loop (a backward branch with
    no other backward branch inside) whose body holds the most MMAs (the prefill kernel's
    copy for full tiles) — as its opcodes and MMA count (mma.sync: 8 a k-step and row group;
    wgmma: 8 a k-step): the decode's integer work is what bounds the kernel, so this is its
    cost, read from the SASS of Triton's cuobjdump."""
    import re
    from triton.backends.nvidia import __file__ as nv
    sass = subprocess.run([os.path.join(os.path.dirname(nv), "bin", "cuobjdump"), "-sass",
                           cubin], capture_output=True, text=True).stdout
    code = [(int(m.group(1), 16), m.group(2)) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);",
                        sass)]
    loops = [(int(b.group(2), 16), int(b.group(1), 16)) for b in re.finditer(
        r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)", sass)]
    loops = [(to, at) for to, at in loops if to < at]
    best: tuple[list[str], int] = ([], 0)
    for to, at in loops:
        if any(to <= t and a <= at and (t, a) != (to, at) for t, a in loops):
            continue  # (an outer loop)
        body = [op.split(".")[0] for a, op in code if to <= a <= at]
        n_mma = body.count("HMMA") + body.count("HGMMA")
        if n_mma > best[1]:
            best = (body, n_mma)
    return best


def compile_cuda(nvrtc: str, arch: int, sass: bool = False) -> int:
    """Compile strata/kernels/exl3_mma.cu with the NVRTC library at `nvrtc` (e.g. from the
    nvidia-cuda-nvrtc wheel) for every set of its compile-time constants, then assemble each
    for sm_<arch> with Triton's ptxas and print registers and spills (`sass`: also the
    k-loop's instructions per k-step, _k_loop)."""
    import ctypes
    import itertools
    import re
    from triton.backends.nvidia import __file__ as nv
    from strata.kernels import exl3_mma
    lib = ctypes.CDLL(nvrtc)
    src = exl3_mma._SOURCE.read_bytes()
    ptxas = os.path.join(os.path.dirname(nv), "bin", "ptxas")
    failures = 0
    rg = exl3_mma.PREFILL_TILE_M // 8
    for K2, CB, OT, BT, R16, G, NW, PF, RS, WG in itertools.product(
            range(4, 13), (0, 1, 2), (0, 1, 2), (-1, 0, 1, 2), (0, 1), (0, 1), (4, 8), (0, 1),
            (0, 1), (0, 1)):
        if K2 % 2 and CB != 2:
            continue  # half-integer K exists with MUL1 only
        if G and (BT >= 0 or R16):
            continue  # grouped: no bias, tiles of 8 rows
        if PF and not (G and NW == 8):
            continue  # the prefill kernel: grouped, 8 warps
        if RS and (G or PF or NW == 8 or OT or BT >= 0):
            continue  # ragged sets: 4 warps, no bias, output dtypes read per set
        if WG and not (PF and arch == 90):
            continue  # wgmma: the prefill kernel's option, on sm_90a only (_prefill_key)
        target = f"{arch}a" if WG else f"{arch}"  # (wgmma: the arch-specific target)
        opts = exl3_mma._options(K2, CB, OT, BT, R16, G, NW, PF, rg if PF else 0,
                                 exl3_mma.PREFILL_MIN_BLOCKS if PF else 0, RS, WG,
                                 exl3_mma.PREFILL_WG_DEPTH if WG else 1) \
            + [f"--gpu-architecture=compute_{target}"]
        prog = ctypes.c_void_p()
        lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"exl3_mma.cu", 0, None, None)
        rc = lib.nvrtcCompileProgram(prog, len(opts),
                                     (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
        n = ctypes.c_size_t()
        if rc != 0:
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetProgramLog(prog, log)
            failures += 1
            print(f"FAILED exl3_mma.cu {opts}: {log.value.decode()[:2000]}", flush=True)
            continue
        lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
        ptx = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetPTX(prog, ptx)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.ptx")
            with open(path, "wb") as f:
                f.write(ptx.value)
            out = subprocess.run([ptxas, f"-arch=sm_{target}", "-v", path, "-o",
                                  os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
            loop = ""
            if sass and out.returncode == 0 and OT == 0 and BT == -1:
                import collections
                body, n_mma = _k_loop(os.path.join(tmp, "k.cubin"))
                groups = 1 if WG else rg if PF else 2 if R16 else 1  # MMAs per tile
                per = len(body) * 8 * groups / max(n_mma, 1)
                top = collections.Counter(body).most_common(6)
                loop = (f"; k-loop {per:.0f} instructions per k-step ("
                        + ", ".join(f"{op} {n * 8 * groups / n_mma:.0f}"
                                    for op, n in top) + ")")
        info = re.findall(r"Used (\d+) registers|(\d+) bytes spill stores", out.stderr)
        if out.returncode != 0:
            failures += 1
            print(f"FAILED ptxas {opts}: {out.stderr[-2000:]}", flush=True)
        elif OT == 0 and BT == -1:  # (one line per K, codebook and row class)
            regs = [a for a, _ in info if a]
            spills = [b for _, b in info if b]
            wd = exl3_mma.PREFILL_WG_DEPTH if WG else 1
            print(f"exl3_mma K2={K2} CB={CB} OT={OT} BT={BT} R16={R16} G={G} NW={NW} PF={PF} "
                  f"RS={RS}{f' WG={WG} WD={wd}' if PF else ''}: "
                  f"{regs[0]} registers, "
                  f"{spills[0] if spills else 0} bytes spilled{loop}", flush=True)
    print(f"exl3_mma.cu compiled for sm_{arch}: {failures} failed")
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--tests", default="tests/test_kernels_*.py")
    p.add_argument("--shared-limit", type=int, metavar="BYTES",
                   help="shared memory a block may have (default: the arch's, SHARED_LIMIT)")
    p.add_argument("--regs", action="store_true",
                   help="print each kernel's registers and shared memory per block")
    p.add_argument("--nvrtc", metavar="LIBNVRTC",
                   help="instead: compile the CUDA kernel source (exl3_mma.cu) with this NVRTC "
                        "library, every constant set, and report registers")
    p.add_argument("--sass", action="store_true",
                   help="with --nvrtc: also the k-loop's instructions per k-step by opcode")
    p.add_argument("--compile-only", metavar="JSONL", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.nvrtc:
        return compile_cuda(args.nvrtc, args.arch, args.sass)
    if args.compile_only:
        return compile_all(args.compile_only, args.arch, args.regs, args.shared_limit)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.jsonl")
        env = dict(os.environ, STRATA_RECORD_LAUNCHES=path, TRITON_INTERPRET="1")
        # (several patterns, space-separated; none matching must not run the whole suite)
        tests = sorted({t for pattern in args.tests.split() for t in glob.glob(pattern)})
        if not tests:
            print(f"--tests {args.tests!r} matches no file")
            return 1
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", *tests], env=env)
        if run.returncode != 0 or not os.path.exists(path):
            print("the kernel tests failed or launched nothing: nothing to compile")
            return 1
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        return subprocess.run([sys.executable, __file__, "--compile-only", path,
                               "--arch", str(args.arch)] + (["--regs"] if args.regs else [])
                              + ([f"--shared-limit={args.shared_limit}"]
                                 if args.shared_limit else []),
                              env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
