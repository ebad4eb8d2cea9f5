"""scripts/compile_check.py's compile side: recorded launches compiled for a GPU with no GPU,
in the forms the GPU runs, and held to the shared memory a block may have there."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from compile_check import SHARED_LIMIT, gpu_forms  # noqa: E402

from strata.kernels import exl3, indexer, mhc  # noqa: E402


def _launch(kernel, types: dict, constexprs: dict, aligned: tuple = (),
            options: dict | None = None) -> dict:
    """A launch as the recorder writes it from the CPU tests (interpreted form): the kernel's
    own argument list, `types` for its pointers and floats, i32 for the other scalars;
    `aligned`: the arguments it saw divisible by 16."""
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in kernel.arg_names}
    return {"module": kernel.fn.__module__, "name": kernel.fn.__name__, "sig": sig,
            "constexprs": constexprs, "aligned": list(aligned),
            "options": options or {"num_warps": 4}}


# mHC's mix and the indexer's scores (16-bit queries and keys: on the GPU their tensor-core
# product, and the split one for fp32 queries).
HC_MIX = _launch(mhc._hc_mix_kernel, dict.fromkeys(("x_ptr", "fn_ptr", "part_ptr"), "*fp32"),
                 {"BT": 16, "BN": 32, "BK": 64, "CHUNK": 256, "SPLIT": False, "PDL": False})
INDEX_SCORES = _launch(
    indexer._index_scores_kernel,
    {"q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*fp32", "vis_ptr": "*i64", "e_ptr": "*fp32",
     "o_ptr": "*fp32", "w_scale": "fp32"},
    {"BLOCK_T": 2, "BLOCK_H": 32, "BLOCK_N": 128, "BLOCK_K": 64, "PRODUCT": 0, "GATHER": False})


def test_each_launch_is_also_compiled_as_the_gpu_runs_it():
    fused_sig = {"x_ptr": "*fp16"}
    forms = gpu_forms("_fused_kernel", fused_sig, {"ASM": False, "BM": 64})
    assert forms == [(fused_sig, {"ASM": False, "BM": 64}),
                     (fused_sig, {"ASM": True, "BM": 64})]
    assert gpu_forms("_pool_kernel", {}, {"LIBDEVICE": True}) == [({}, {"LIBDEVICE": True})]
    desc = {"x_desc": "tensordesc<fp16[128, 128]>", "y_ptr": "*fp32"}
    for arch, joined in ((90, False), (120, True), (89, True)):  # (interpreted: never joined)
        assert gpu_forms("_gemm_kernel", {}, {"JOIN_B": False}, arch) == [({}, {"JOIN_B": joined})]
        # (interpreted: through TMA, which only sm_90 keeps)
        assert gpu_forms("_gemm_kernel", desc, {"JOIN_B": False, "TMA": True}, arch) == [(
            desc if arch == 90 else {"x_desc": "*fp16", "y_ptr": "*fp32"},
            {"JOIN_B": joined, "TMA": arch == 90})]
    sig, consts = INDEX_SCORES["sig"], INDEX_SCORES["constexprs"]
    forms = gpu_forms("_index_scores_kernel", sig, consts)
    assert [c["PRODUCT"] for _, c in forms] == [0, 1, 2]
    assert forms[1][0] == sig  # (16-bit pairs: as recorded)
    assert (forms[2][0]["q_ptr"], forms[2][0]["k_ptr"]) == ("*fp32", "*bf16")
    assert SHARED_LIMIT[120] == SHARED_LIMIT[89] == 99 * 1024  # (the reference box; a 4090)


def _compile_check(path, *extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (silences Triton 3.9's notice)
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_check.py"),
                           "--compile-only", str(path), "--arch", "120", *extra], env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_launch_past_the_targets_shared_memory_fails(tmp_path):
    """Compiled for sm_120 in a process without the interpreter: both launches fit its 99 KiB;
    held to 1 KiB, each form is a failure named with its bytes, and the exit status says so."""
    path = tmp_path / "launches.jsonl"
    path.write_text("".join(json.dumps(la) + "\n" for la in (HC_MIX, INDEX_SCORES)))
    fits = _compile_check(path)
    assert fits.returncode == 0, fits.stdout[-3000:] + fits.stderr[-3000:]
    # hc_mix with and without early launch; the scores in their three products
    assert "5 distinct launches of 2 kernels compiled for sm_120: 0 failed" in fits.stdout
    tight = _compile_check(path, "--shared-limit=1024")
    assert tight.returncode == 1
    failed = [line for line in tight.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 5 and all("more than a block may have (1024 B)" in f for f in failed)
    assert "5 distinct launches of 2 kernels compiled for sm_120: 5 failed" in tight.stdout


def test_aligned_arguments_compile_as_a_launch_specialises_them(tmp_path):
    """The prefill GEMM as sm_120 launches it (Ŵ joined, 3 stages): given its pointers and row
    strides as divisible by 16, as Triton's launcher finds them, its A tiles are copied ahead
    (cp.async, the software pipeline) and it takes more shared memory than compiled without —
    what session 42's reading (one stage) missed."""
    consts = {"BM": exl3.GEMM_BLOCK_M, "BN": exl3.GEMM_BLOCK_N, "BK": exl3.BLOCK_K,
              "JOIN_B": True, "TMA": False}
    types = {"x_ptr": "*fp16", "w_ptr": "*fp16", "x_desc": "*fp16", "w_desc": "*fp16",
             "y_ptr": "*fp32"}
    options = {"num_warps": exl3.GEMM_NUM_WARPS, "num_stages": exl3.GEMM_NUM_STAGES}
    shared = []
    for aligned in ((), ("x_ptr", "w_ptr", "y_ptr", "sx_row", "sw_row", "sy_row")):
        path = tmp_path / f"gemm{len(aligned)}.jsonl"
        path.write_text(json.dumps(_launch(exl3._gemm_kernel, types, consts, aligned,
                                           options)) + "\n")
        out = _compile_check(path)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        line = next(x for x in out.stdout.splitlines() if x.startswith("most shared memory"))
        shared.append(int(line.split("_gemm_kernel ")[1].split(" B")[0]))
    assert shared[1] > shared[0], shared
    assert shared[1] <= SHARED_LIMIT[120], shared  # (it still fits the reference box)
