"""strata.kernels.pdl: when kernels launch early, and that every early-launched kernel waits
for the one before it before anything else (what keeps stream order exact)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from strata.kernels import pdl

KERNELS = Path(pdl.__file__).parent


def test_no_early_launch_off_the_gpu_or_when_switched_off(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch(cpu) == {} and pdl.args(cpu) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch(torch.device("cuda", 0)) == {}  # (switched off: no device query)
    assert pdl.args(torch.device("cuda", 0)) == {"PDL": False}


def test_the_interpreter_never_launches_early(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch(torch.device("cuda", 0), on=True) == {}


def _pdl_kernels():
    """(file, kernel) for every Triton kernel with a PDL parameter launched through pdl.args:
    all kernel modules but exl3.py, whose own early launch (rotate_in → its matmul) is
    documented there."""
    for path in sorted(KERNELS.glob("*.py")):
        if path.name in ("exl3.py", "pdl.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.FunctionDef)
                    and any(a.arg == "PDL" for a in node.args.args)
                    and any("jit" in ast.unparse(d) for d in node.decorator_list)):
                yield path.name, node


def _may_precede_the_wait(stmt: ast.stmt) -> bool:
    """What an early-launched kernel may do before its wait: ask L2 for data no kernel of the
    step writes (pdl.prefetch_l2 — a weight), with the arithmetic of its addresses; no load,
    store or atomic."""
    text = ast.unparse(stmt)
    return "prefetch_l2(" in text and not any(
        op in text for op in ("tl.load", "tl.store", "tl.atomic"))


def test_every_early_launched_kernel_waits_first():
    found = list(_pdl_kernels())
    assert len(found) >= 15, [f"{f}:{k.name}" for f, k in found]
    for name, fn in found:
        body = [s for s in fn.body
                if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        while body and _may_precede_the_wait(body[0]):
            body = body[1:]
        assert ast.unparse(body[0]) == "wait_then_release(PDL)", f"{name}:{fn.name}"


def test_a_load_before_the_wait_is_caught():
    """The rule above refuses a prefetch that also reads memory."""
    ok = ast.parse("if HAS_W:\n    prefetch_l2(w_ptr + line * 128, PDL)").body[0]
    bad = ast.parse("if HAS_W:\n    prefetch_l2(w_ptr + tl.load(i_ptr), PDL)").body[0]
    assert _may_precede_the_wait(ok) and not _may_precede_the_wait(bad)


@pytest.mark.parametrize("name", ["norm.py", "rope.py", "mhc.py", "rowwise.py", "attention.py",
                                  "moe_ops.py", "qdq.py", "ring.py", "moe_grouping.py"])
def test_their_launches_pass_the_launch_arguments(name):
    """Each module's kernels with a PDL parameter are launched with **pdl.args(...): the PDL
    constexpr and the launch option come from one call, so no kernel launches early without
    its wait compiled in."""
    src = (KERNELS / name).read_text()
    tree = ast.parse(src)
    pdl_kernels = {fn.name for f, fn in _pdl_kernels() if f == name}
    launches = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Subscript)
                and isinstance(n.func.value, ast.Name) and n.func.value.id in pdl_kernels]
    assert launches, name
    for call in launches:
        assert any(k.arg is None and "pdl.args" in ast.unparse(k.value) for k in call.keywords), \
            f"{name}: {ast.unparse(call)[:80]}"


def test_rotate_in_waits_first_and_is_launched_with_its_wait_compiled_in(monkeypatch):
    """exl3's rotate_in is launched early like the small kernels: its first statement waits
    for the kernel before it (then lets its matmul launch), and its launch arguments set the
    PDL constexpr whenever they set the launch option."""
    from strata.kernels import exl3
    fn = next(n for n in ast.walk(ast.parse((KERNELS / "exl3.py").read_text()))
              if isinstance(n, ast.FunctionDef) and n.name == "_rotate_in_kernel")
    first = [s for s in fn.body
             if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))][0]
    assert ast.unparse(first) == "if PDL:\n    gdc_wait()\n    gdc_launch_dependents()"
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "launch", lambda device, on=None: {"launch_pdl": True})
    assert exl3._rotate_launch(dev) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "launch", lambda device, on=None: {})
    assert exl3._rotate_launch(dev) == {"PDL": False}
    # the matmul's early launch alone (small kernels' switched off): it still releases
    monkeypatch.setattr(pdl, "ENABLED", False)
    monkeypatch.setattr(pdl, "launch", lambda device, on=None:
                        {"launch_pdl": True} if (pdl.ENABLED if on is None else on) else {})
    assert exl3._rotate_launch(dev) == {"PDL": True}
