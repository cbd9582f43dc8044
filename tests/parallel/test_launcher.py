"""launch(): N gloo processes on torch.distributed.elastic from a script, `python -c`, and a real notebook."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from speedups import SpeedupsError, launch
from tests._dist import _env

# The training function both the script and the notebook define: each rank all-reduces (rank + 1) and
# returns what it saw, so the parent can check rank order, arguments and a working gloo process group.
TRAIN = """
import os, torch
from speedups import default_device, launch

def train(base, *, scale=1):
    t = torch.tensor([float(torch.distributed.get_rank() + 1)])
    torch.distributed.all_reduce(t)
    assert str(default_device()) == "cpu"
    return (int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), torch.distributed.get_backend(),
            base * scale, t.item())

def broken(where):
    if int(os.environ["RANK"]) == where:
        raise KeyError(f"no such column on rank {where}")
    import time; time.sleep(30)  # the others are stopped by the agent
"""
EXPECTED = "[(0, 0, 'gloo', 20, 3.0), (1, 1, 'gloo', 20, 3.0)]"


def _run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=_env(None), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.distributed
def test_launch_from_a_script_spawns_and_returns_rank_order(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        TRAIN
        + textwrap.dedent("""
        if __name__ == "__main__":
            print("RESULT", launch(train, 10, nprocs=2, scale=2))
            print("ENV", sorted(k for k in os.environ if k.startswith("TORCHELASTIC")))
    """)
    )
    out = _run([sys.executable, str(script)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"RESULT {EXPECTED}" in out.stdout
    assert "ENV []" in out.stdout  # nothing left behind in the parent's environment


@pytest.mark.slow
@pytest.mark.distributed
def test_launch_from_python_c_forks_and_a_childs_traceback_reaches_the_parent(tmp_path: Path) -> None:
    code = TRAIN + textwrap.dedent("""
        print("RESULT", launch(train, 10, nprocs=2, scale=2))
        print("LAMBDA", launch(lambda: 7, nprocs=2))
        try:
            launch(broken, 1, nprocs=2)
        except KeyError as err:
            import traceback
            print("CAUGHT", repr(err), err.__notes__)
            traceback.print_exc()
    """)
    out = _run([sys.executable, "-c", code], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"RESULT {EXPECTED}" in out.stdout and "LAMBDA [7, 7]" in out.stdout
    assert "CAUGHT KeyError('no such column on rank 1')" in out.stdout and "process rank 1" in out.stdout
    # The child's own traceback (its frame in broken(), the raising line) reaches the parent as the cause.
    cause = out.stderr.split("The above exception was the direct cause")[0].split("_ChildTraceback")[-1]
    line = next(i for i, text in enumerate(code.splitlines(), 1) if "raise KeyError" in text)
    assert f'File "<string>", line {line}, in broken' in cause, out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_launch_from_a_notebook_cell_on_ipykernel(tmp_path: Path, monkeypatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(TRAIN),
        nbformat.v4.new_code_cell("launch(train, 10, nprocs=2, scale=2)"),
    ]
    for key, value in _env(None).items():  # the kernel inherits PYTHONPATH, OMP_NUM_THREADS, no RANK...
        monkeypatch.setenv(key, value)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    result = nb.cells[1].outputs[0]
    assert result["output_type"] == "execute_result", nb.cells[1].outputs
    assert result["data"]["text/plain"] == EXPECTED


def test_launch_bad_arguments_and_refusals(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"launch\(.*nprocs=0.*\): nprocs=0"):
        launch(print, nprocs=0)
    with pytest.raises(TypeError, match="not callable"):
        launch(3, nprocs=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_restarts=-1"):
        launch(print, nprocs=2, max_restarts=-1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SpeedupsError, match="already one of 2 processes"):
        launch(print, nprocs=2)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(SpeedupsError, match="CUDA is already initialised"):
        launch(lambda: 1, nprocs=2)  # a lambda cannot be imported by a child: fork, refused


def test_the_start_method_follows_whether_a_child_can_import_the_function() -> None:
    from speedups.parallel.launcher import _importable

    assert _importable(launch) and _importable(test_launch_bad_arguments_and_refusals)
    assert not _importable(lambda: 1)

    def local() -> None:
        pass

    assert not _importable(local)


def test_a_main_read_from_stdin_is_not_importable(monkeypatch) -> None:
    """`python - < job.py` sets __main__.__file__ to "<stdin>": spawn would fail to re-run it, so fork."""
    import types

    from speedups.parallel.launcher import _importable

    def job() -> None:
        pass

    job.__module__, job.__qualname__ = "__main__", "job"
    main = types.ModuleType("__main__")
    main.__file__ = "<stdin>"
    main.job = job  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert not _importable(job)
    main.__file__ = __file__  # a real script file: spawn can re-run it
    assert _importable(job)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("how", ["script", "stdin"])
def test_launch_gives_each_process_one_thread_as_torchrun_does(tmp_path: Path, how: str) -> None:
    code = textwrap.dedent("""
        import os, torch
        from speedups import launch

        def threads():
            return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]

        if __name__ == "__main__":
            print("RESULT", launch(threads, nprocs=2), "OMP" in str(sorted(os.environ)))
    """)
    env = _env(None)
    env.pop("OMP_NUM_THREADS", None)
    default = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if int(default.stdout) < 2:
        pytest.skip("one CPU thread by default here: nothing to oversubscribe")
    script = tmp_path / "job.py"
    script.write_text(code)
    args = [sys.executable, str(script)] if how == "script" else [sys.executable, "-"]
    out = subprocess.run(
        args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        input=None if how == "script" else code,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT [(1, '1'), (1, '1')] False" in out.stdout, out.stdout  # and the parent's env is restored


@pytest.mark.slow
@pytest.mark.distributed
def test_a_return_value_that_cannot_be_pickled_is_named_as_the_cause(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import threading
        from speedups import launch

        def make_lock():
            return {"lock": threading.Lock()}

        try:
            launch(make_lock, nprocs=2)
        except TypeError as err:
            print("CAUGHT", err)
    """)
    out = _run([sys.executable, "-c", code], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CAUGHT launch(make_lock): make_lock returned {'lock': <unlocked _thread.lock" in out.stdout
    assert "cannot be pickled to reach the parent process" in out.stdout and "Return plain data" in out.stdout
    assert "Killed for memory" not in out.stdout + out.stderr
