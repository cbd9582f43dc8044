"""Contract tests: public surface, import side effects, README and CI agreement, README examples run."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import speedups

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_public_names_are_pinned() -> None:
    assert sorted(speedups.__all__) == sorted(
        [
            "AccumulationPlan",
            "DevicePrefetcher",
            "DistributedLoader",
            "LoaderReport",
            "LossTracker",
            "MetricLogger",
            "RunDirectory",
            "SpeedupsError",
            "SpeedupsWarning",
            "StepProfiler",
            "StopOnSignal",
            "UpdateRecord",
            "__version__",
            "accumulate",
            "accumulation_plan",
            "check",
            "checkpoint_activations",
            "checkpoint_values",
            "compile_blocks",
            "ddp_wrap",
            "default_device",
            "destroy_distributed",
            "deterministic",
            "distributed",
            "fast_kernels",
            "fast_loader",
            "find_batch_size",
            "gather",
            "init_distributed",
            "is_main_process",
            "launch",
            "load_checkpoint",
            "local_rank",
            "main_process_first",
            "mixed_precision",
            "plot_metrics",
            "prefetch_to_device",
            "profile_steps",
            "rank",
            "rank_zero_only",
            "rank_zero_print",
            "resolve_device",
            "save_checkpoint",
            "seed_everything",
            "shard_model",
            "to_device",
            "tune_loader",
            "uncompile_blocks",
            "uncheckpoint_activations",
            "unshard_model",
            "world_size",
        ]
    )
    for name in speedups.__all__:
        assert hasattr(speedups, name), name


def test_every_public_callable_has_a_docstring() -> None:
    for name in speedups.__all__:
        obj = getattr(speedups, name)
        if callable(obj):
            assert obj.__doc__ and len(obj.__doc__.strip()) > 40, name


@pytest.mark.slow
def test_import_has_no_side_effects() -> None:
    code = (
        "import os, sys, torch\n"
        "before = set(sys.modules)\n"
        "env = dict(os.environ)\n"
        "flags = (torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision(),"
        " torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())\n"
        "import speedups, logging\n"
        "assert dict(os.environ) == env, set(os.environ.items()) ^ set(env.items())\n"
        "assert flags == (torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision(),"
        " torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "assert not new & {'torchvision', 'tqdm', 'matplotlib', 'sklearn'}, new\n"
        "assert not logging.getLogger().handlers\n"
        "assert not (torch.distributed.is_available() and torch.distributed.is_initialized())\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_version_is_single_sourced() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["tool"]["setuptools"]["dynamic"]["version"]["attr"] == "speedups.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+", speedups.__version__)


def test_runtime_dependencies_are_exactly_torch_wrapt_typing_extensions() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = {re.split(r"[<>=!~ ]", d)[0] for d in meta["project"]["dependencies"]}
    assert names == {"torch", "wrapt", "typing-extensions"}
    assert not any("==" in d for d in meta["project"]["dependencies"]), "no pins in the package itself"


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)


def test_readme_starts_with_the_two_commands_and_ci_runs_the_second() -> None:
    blocks = _bash_blocks()
    run_example, run_tests = blocks[0].strip(), blocks[1].strip()
    assert "examples/train_digits.py" in run_example and run_example.startswith("python3 -m venv .venv")
    assert "pytest" in run_tests and run_tests.startswith("python3 -m venv .venv")
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"TEST_COMMAND='{run_tests}'" in ci


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)\n```", README, flags=re.S)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_examples_run(index: int, tmp_path: Path) -> None:
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(_python_blocks()[index])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------------------------------- the layout
PACKAGE = ROOT / "speedups"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _defines_all(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


def test_the_package_has_a_folder_per_concern_each_listing_what_it_offers() -> None:
    top = [p.name for p in PACKAGE.iterdir() if p.name not in ("py.typed", "__pycache__")]
    assert len(top) <= 18, sorted(top)  # 18: lint/ (issue 45); kernels/ took in reproducible.py (38)
    folders = [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    assert len(folders) >= 6
    for folder in folders:
        init = folder / "__init__.py"
        assert init.is_file() and _defines_all(init), folder
    missing = [name for name, path in _modules().items() if not _defines_all(path)]
    assert not missing, missing


def test_no_module_or_folder_is_named_like_a_public_function() -> None:
    public = {name for name in speedups.__all__ if callable(getattr(speedups, name))}
    names = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    assert not names & public, names & public


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every speedups module ``path`` imports, anywhere in it (TYPE_CHECKING blocks and functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("speedups"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("speedups")}
    return found & known


def test_no_import_cycle_among_speedups_modules() -> None:
    modules = _modules()
    graph = {name: _imports(path, set(modules)) for name, path in modules.items()}
    # A module is in a cycle when it can reach itself; report the first cycle found, as a path.
    for start in graph:
        stack, seen = [(start, (start,))], set()
        while stack:
            node, way = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    pytest.fail("import cycle: " + " -> ".join((*way, start)))
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*way, nxt)))


@pytest.mark.slow
def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    """Whatever a user (or a worker process) imports first, the package loads: no half-initialised module."""
    code = (
        "import importlib, sys\n"
        f"for name in {sorted(_modules())!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'speedups' or m.startswith('speedups.')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
        "import speedups\n"
        "assert all(hasattr(speedups, name) for name in speedups.__all__)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
