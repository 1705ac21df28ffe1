"""The operator registry (``mcore_npu.ops.registry``): one table, one policy, one importer.

No NPU here: the Ascend packages are stand-in modules in ``sys.modules`` (``_stand_ins``), and
NPU tensors are a device object whose ``type`` is ``"npu"`` (the registry reads only that).

- The policy, for every registered operator and each of its Ascend kernels: a kernel asked for
  by name that cannot run raises naming the reason (not installed: ImportError; installed
  without the attribute: ValueError); ``auto`` on NPU tensors picks the first kernel that can;
  where none can, the reference with one warning per process naming the operator and reasons;
  ``auto`` elsewhere is the reference, silently.
- The registry imports without torch; exactly one module imports the Ascend packages
  (``mcore_npu/_optional.py``); no module but the registry reaches a torch_npu attribute.
- ``mcore_npu.ops.<name>`` is every registered operator's function; every path resolves.
"""

from __future__ import annotations

import ast
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import mcore_npu
import mcore_npu.ops
from mcore_npu.ops import registry
from mcore_npu.ops.gated_delta import fla_npu_chain
from tests import batch_invariant_ops_standin
from tests.launch import ROOT, run_command

PACKAGE = Path(mcore_npu.__file__).resolve().parent
NPU = types.SimpleNamespace(type="npu", index=0)
BF16 = types.SimpleNamespace(dtype=torch.bfloat16, shape=(1, 64, 4, 128))
# facts of a call every kernel of the operator can take (the probes read them)
GOOD_FACTS = {
    "rotary_mul": {"rotary_mode": "half", "head_dim": 128},
    "grouped_matmul": {"keywords": ()},
    "chunk_gated_delta_rule": {"grad": False, "q": BF16, "v": BF16},
    "causal_conv1d": {"width": 3, "dtype": "bfloat16"},
}
ASCEND_950 = 260  # torch_npu.npu.get_soc_version() of an Ascend 950
KERNELLED = [(name, kernel.name) for name, op in registry.OPERATORS.items()
             for kernel in op.kernels]  # fmt: skip


def _stand_ins(monkeypatch, *, missing=(), without=(), soc=ASCEND_950) -> None:
    """Every registered Ascend module in ``sys.modules`` with every attribute the table names
    (fla_npu's building blocks too; the AscendC library's ``torch.ops`` namespace), except the
    modules in ``missing`` (their import fails) and the attributes in ``without``."""
    batch_invariant_ops_standin.define()
    modules: dict[str, types.ModuleType] = {}
    for op in registry.OPERATORS.values():
        for kernel in op.kernels:
            module = modules.setdefault(kernel.module, types.ModuleType(kernel.module))
            names = (*kernel.attributes, *(fla_npu_chain.OPS if kernel.name == "fla_npu" else ()))
            for name in names:
                if name not in without:
                    setattr(module, name, lambda *args, **kwargs: None)
    modules["torch_npu"].npu = types.SimpleNamespace(get_soc_version=lambda: soc)
    for name in {n for m in modules for n in _parents(m)}:
        monkeypatch.setitem(sys.modules, name, modules.get(name, types.ModuleType(name)))
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # import raises


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


@pytest.mark.parametrize(("op", "kernel"), KERNELLED)
def test_a_kernel_asked_for_by_name_that_cannot_run_raises_naming_why(monkeypatch, op, kernel):
    module = next(k.module for k in registry.operator(op).kernels if k.name == kernel)
    _stand_ins(monkeypatch, missing=[module])
    with pytest.raises(ImportError, match=f"{module.split('.')[0]}: failed to import.*\n.*fix"):
        registry.resolve(op, kernel, NPU, **GOOD_FACTS.get(op, {}))
    attributes = next(k.attributes for k in registry.operator(op).kernels if k.name == kernel)
    if attributes:
        _stand_ins(monkeypatch, without=attributes)
        with pytest.raises(ValueError, match=f"{op}: kernel '{kernel}' cannot run this call: "
                           f"the installed {module} has no {attributes[0]}"):  # fmt: skip
            registry.resolve(op, kernel, torch.device("cpu"), **GOOD_FACTS.get(op, {}))
    _stand_ins(monkeypatch)
    assert registry.resolve(op, kernel, torch.device("cpu"), **GOOD_FACTS.get(op, {})).kernel == (
        kernel
    )


@pytest.mark.parametrize("op", registry.OPERATORS)
def test_auto_picks_the_ascend_kernel_on_npu_else_the_reference_with_one_warning(monkeypatch, op):
    spec = registry.operator(op)
    facts = GOOD_FACTS.get(op, {})
    _stand_ins(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # off the NPU, and with the kernels there: no warning
        assert registry.resolve(op, "auto", torch.device("cpu"), **facts).kernel == "reference"
        if spec.kernels:
            assert registry.resolve(op, "auto", NPU, **facts).kernel == spec.kernels[0].name
    _stand_ins(monkeypatch, missing=[k.module for k in spec.kernels])
    with pytest.warns(UserWarning, match=f"^{op}: using the PyTorch reference on the NPU") as seen:
        first = registry.resolve(op, "auto", NPU, **facts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per process
        assert registry.resolve(op, "auto", NPU, **facts) == first
    assert len(seen) == 1 and first.kernel == "reference" and first.fell_back
    assert len(first.reasons) == max(1, len(spec.kernels))


def test_a_probe_that_refuses_moves_auto_to_the_next_kernel(monkeypatch):
    _stand_ins(monkeypatch)
    resolution = registry.resolve("chunk_gated_delta_rule", "auto", NPU, grad=True, q=BF16, v=BF16)
    assert resolution.kernel == "fla_npu"
    assert resolution.reasons == ("torch_npu: it is forward only (no derivative) and this call "
                                  "needs gradients",)  # fmt: skip


def test_unknown_operators_and_kernels_are_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match="'rms_nrom' is not registered; did you mean 'rms_norm'"):
        registry.resolve("rms_nrom")
    with pytest.raises(ValueError, match="kernel: unknown kernel 'fla'; pass one of auto, "
                       "torch_npu, reference"):  # fmt: skip
        registry.resolve("rms_norm", "fla")
    assert registry.operator("chunk_gated_delta_rule").kernel_names == (
        "auto", "torch_npu", "fla_npu", "fla", "reference")  # fmt: skip
    assert registry.check_kernel("off", off=True) == "off"


def test_the_registry_imports_without_torch():
    code = "import sys; import mcore_npu.ops.registry; assert 'torch' not in sys.modules"
    done = run_command([sys.executable, "-c", code], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_registered_operator_is_mcore_npu_ops_name_and_every_path_resolves():
    for name, op in registry.OPERATORS.items():
        function = registry._resolve_path(op.function)
        assert getattr(mcore_npu.ops, name) is function, name
        assert callable(registry.reference(name))
        if op.validator:
            assert callable(registry._resolve_path(op.validator))
        for kernel in op.kernels:
            if kernel.probe:
                assert callable(registry._resolve_path(kernel.probe))


ASCEND = ("torch_npu", "fla_npu", "fla", "flash_attn_npu")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def _imported_names(tree) -> set[str]:
    """Ascend packages named by an import statement or a string given to an import function."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.add(first.value.split(".")[0])
    return found & set(ASCEND)


def test_exactly_one_module_imports_the_ascend_packages():
    importers = {path for path, tree in _modules() if _imported_names(tree)}
    assert importers == set(), importers  # _optional.py imports them by a name it is given
    source = (PACKAGE / "_optional.py").read_text()
    assert "importlib.import_module(name)" in source


def test_no_module_but_the_registry_reaches_a_torch_npu_attribute():
    """``torch_npu.<x>``, ``load_torch_npu().<x>`` or ``load("torch_npu").<x>`` outside the
    registry: the kernels are reached only through ``registry.ascend``."""
    offenders = []
    for path, tree in _modules():
        if path == "ops/registry.py":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            value = node.value
            named = isinstance(value, ast.Name) and value.id == "torch_npu"
            loaded = (isinstance(value, ast.Call)
                      and getattr(value.func, "id", getattr(value.func, "attr", None))
                      in ("load_torch_npu", "load"))  # fmt: skip
            if named or loaded:
                offenders.append(f"{path}:{node.lineno} .{node.attr}")
    assert offenders == [], offenders


def _docs_row(op: registry.Operator) -> str:
    kernels = "; ".join(
        f"{k.name}: " + (", ".join(f"`{a}`" for a in k.attributes) or f"`{k.module}`")
        for k in op.kernels
    )
    validator = f"`{op.validator.replace(':', '.')}`" if op.validator else "none"
    reference = op.reference.replace(":", ".")
    return f"| `{op.name}` | {kernels or 'none'} | `{reference}` | {validator} |"


def test_the_docs_table_is_the_registry():
    """docs/ops.md lists every operator with its kernels in ``auto``'s order, and nothing else."""
    text = (ROOT / "docs" / "ops.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows == [_docs_row(op) for op in registry.OPERATORS.values()]


def test_a_kernel_for_a_newer_soc_is_passed_over_naming_the_soc(monkeypatch):
    """npu_masked_causal_conv1d runs on the Ascend 950 only (SoC 260); an A2 (SoC 223) falls
    back, and asking for it there raises; its probe refuses other widths and dtypes."""
    _stand_ins(monkeypatch, soc=223)
    with pytest.warns(UserWarning, match="causal_conv1d: .*SoC 260\\+ only .* SoC 223"):
        assert registry.resolve("causal_conv1d", "auto", NPU, width=3).kernel == "reference"
    with pytest.raises(ValueError, match="kernel 'torch_npu' cannot run this call: .*SoC 223"):
        registry.resolve("causal_conv1d", "torch_npu", NPU, width=3)
    _stand_ins(monkeypatch)
    refusals = ({"width": 4}, "width 3 only"), ({"dtype": "float32"}, "bfloat16 only"), (
        {"grad": True}, "no backward")  # fmt: skip
    for facts, why in refusals:
        with pytest.raises(ValueError, match=why):
            registry.resolve("causal_conv1d", "torch_npu", NPU, **facts)
