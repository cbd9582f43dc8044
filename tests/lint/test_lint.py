"""``python -m speedups.lint``: the findings on scripts in the shapes public ones have, line by line; the
exit status; ``--diff`` applied with ``patch -p1`` and the patched script run against the original.

The scripts are tests/lint/scripts/*.py; each place a reviewer would mark carries ``# check: <topic>`` on
its line, and the check must find exactly those (the expert loop carries none).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from speedups.lint import lint_source, rewrite_source
from speedups.lint.rules import RULES
from tests._dist import ROOT

SCRIPTS = Path(__file__).parent / "scripts"
NAMES = sorted(p.name for p in SCRIPTS.glob("*.py"))
MARK = re.compile(r"#\s*check:\s*(\S+)")


def _marked(path: Path) -> set[tuple[int, str]]:
    lines = enumerate(path.read_text().splitlines(), 1)
    return {(i, m.group(1)) for i, line in lines if (m := MARK.search(line))}


def _check(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "speedups.lint", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_each_script_gets_exactly_the_findings_a_reviewer_marks(name: str) -> None:
    path = SCRIPTS / name
    found = lint_source(path.read_text(), str(path))
    assert {(f.line, f.topic) for f in found} == _marked(path), "\n".join(map(str, found))
    for f in found:  # path:line: tip N (name): ... [docs page], the page there
        shape = rf"{re.escape(str(path))}:{f.line}: (tip \d+ \([^)]+\)|[a-z_]+): .+ \[docs/\S+\.md\]"
        assert re.fullmatch(shape, str(f)), str(f)
        assert (ROOT / str(f).rsplit("[", 1)[1].rstrip("]")).is_file()


def test_the_fixtures_cover_every_rule() -> None:
    topics = {t for name in NAMES for _, t in _marked(SCRIPTS / name)}
    assert {
        "1",
        "4",
        "5",
        "6",
        "7",
        "9",
        "checkpoints",
        "compile_blocks",
        "fast_kernels",
        "migration",
    } <= topics
    assert len(RULES) == 9


def test_exit_status_summary_and_a_file_that_does_not_parse(tmp_path: Path) -> None:
    done = _check(str(SCRIPTS / "expert.py"))
    assert done.returncode == 0 and "nothing to change in these scripts" in done.stdout, done.stderr
    done = _check(str(SCRIPTS / "mnist_style.py"))
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines()[-1].startswith(
        "speedups.lint: 6 places in 1 file: tip 1 (fast_loader) x1"
    )
    broken = tmp_path / "broken.py"
    broken.write_text("for x in y:\n    print(x\n")
    shutil.copy(SCRIPTS / "gan_style.py", tmp_path / "gan.py")
    done = _check(str(tmp_path))
    assert done.returncode == 2
    said = rf"{re.escape(str(broken))}:2: cannot parse it \(.*\); the other files were checked"
    assert re.search(said, done.stderr), done.stderr
    assert f"{tmp_path / 'gan.py'}:13: tip 1 (fast_loader)" in done.stdout  # the other file still checked
    assert "1 file could not be read (above); 6 places in 1 file" in done.stdout
    done = _check(str(tmp_path / "missing.py"))
    assert done.returncode == 2 and "cannot read it (FileNotFoundError" in done.stderr
    assert "could not be read (above); nothing to change in the others" in done.stdout


def test_the_check_never_imports_or_runs_the_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    marker = tmp_path / "ran"
    script.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\nimport not_a_module\n")
    done = _check(str(script))
    assert done.returncode == 0 and not marker.exists(), done.stdout + done.stderr


@pytest.mark.parametrize(
    "source",
    [
        # .item() only every N steps; the copy non-blocking from pinned memory; clipping after unscale_;
        # a torch.save under the rank check; set_epoch on the sampler; autocast on.
        "import torch\nfor i, (x, y) in enumerate(loader):\n    x = x.to(device, non_blocking=True)\n"
        "    with torch.autocast('cuda'):\n        loss = model(x).sum()\n    scaler.scale(loss).backward()\n"
        "    scaler.unscale_(opt)\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "    if i % 100 == 0:\n        print(loss.item())\n",
        "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(model)\n"
        "sampler = DistributedSampler(ds)\nfor epoch in range(3):\n    sampler.set_epoch(epoch)\n"
        "    for x in loader:\n        with torch.autocast('cuda'):\n            loss = model(x)\n"
        "        loss.backward()\n    if rank == 0:\n        torch.save({'model': model.state_dict(), "
        "'optimizer': opt.state_dict(), 'epoch': epoch, 'rng': torch.get_rng_state()}, 'c.pt')\n",
        # a validation sampler that does not shuffle needs no set_epoch
        "import torch\nmodel = DDP(model)\nval = DistributedSampler(ds, shuffle=False)\n",
        # accumulation by hand written right: micro-steps in their own loop, DDP's no_sync around them
        "import torch\nmodel = DDP(model)\nfor x in loader:\n    for k in range(4):\n"
        "        ctx = model.no_sync() if k < 3 else nullcontext()\n"
        "        with ctx, torch.autocast('cuda'):\n"
        "            loss = model(x[k]) / 4\n            loss.backward()\n    opt.step()\n",
    ],
    ids=["a-careful-step", "a-careful-ddp-epoch", "val-sampler", "accumulation-with-no-sync"],
)
def test_no_finding_where_the_script_already_does_the_right_thing(source: str) -> None:
    assert lint_source(source) == []


def _losses(script: Path, cwd: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line.startswith("loss=")]


CHANGED = [n for n in NAMES if rewrite_source((SCRIPTS / n).read_text()) != (SCRIPTS / n).read_text()]


@pytest.mark.slow
@pytest.mark.parametrize("name", CHANGED)
def test_each_diff_applies_with_patch_and_the_patched_script_trains_the_same(
    name: str, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPTS / name, work / "scripts" / name)
    done = _check("--diff", f"scripts/{name}", cwd=work)
    assert done.returncode == 1 and done.stdout.startswith(f"--- a/scripts/{name}"), done.stdout + done.stderr
    assert "speedups.lint:" in done.stderr  # the findings go to stderr with --diff: stdout is the patch
    shutil.copytree(work, tmp_path / "original")
    patched = subprocess.run(["patch", "-p1"], input=done.stdout, cwd=work, capture_output=True, text=True)
    assert patched.returncode == 0, patched.stdout + patched.stderr
    source = (work / "scripts" / name).read_text()
    compile(source, name, "exec")
    assert "from speedups import" in source
    if name == "accelerate_style.py" and importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed: the patched script parsed, not run")
    before = _losses(tmp_path / "original" / "scripts" / name, tmp_path / "original")
    after = _losses(work / "scripts" / name, work)
    assert before and after == before


def test_write_applies_it_and_keeps_the_original(tmp_path: Path) -> None:
    script = tmp_path / "mnist.py"
    shutil.copy(SCRIPTS / "mnist_style.py", script)
    done = _check("--write", str(script))
    assert done.returncode == 1
    assert (tmp_path / "mnist.py.orig").read_text() == (SCRIPTS / "mnist_style.py").read_text()
    assert "to_device((data, target), device)" in script.read_text()
    assert lint_source(script.read_text(), "mnist.py") != []  # what needs a person is still said


def test_our_examples_findings_are_the_ones_the_docs_explain() -> None:
    """docs/lint.md lists each finding on examples/ with why the example keeps it: the same set."""
    table = (ROOT / "docs" / "lint.md").read_text().split("## Our own examples", 1)[1].split("## ", 1)[0]
    listed = set(re.findall(r"^\| `(examples/\S+\.py):(\d+)` \| (?:tip )?(\S+) \|", table, re.M))
    done = _check("examples")
    assert done.returncode == 1, done.stderr
    found = set(re.findall(r"^(examples/\S+\.py):(\d+): (?:tip )?(\w+)", done.stdout, re.M))
    assert found == listed and len(found) >= 1, (found, listed)


LOOP = "import torch\nfor x, y in loader:\n    loss = model(x).sum()\n    loss.backward()\n"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # an evaluation loop over a loader: a sync per batch too
        (LOOP + "for x, y in val_loader:\n    hits += model(x).argmax(1).eq(y).sum().item()\n", {(6, "5")}),
        # the old idiom, through a name for the CUDA tensor type
        (LOOP + "Tensor = torch.cuda.FloatTensor\nfor x, in loader:\n    real = x.type(Tensor)\n"
         "    d = crit(net(real), t)\n    d.backward()\n", {(7, "6")}),
        # a loss kept every N steps still keeps its graph
        (LOOP + "    if i % 5 == 0:\n        kept.append(loss)\n", {(6, "5")}),
        # a copy in a function the step calls
        ("import torch\ndef get_batch():\n    x, y = data()\n    x, y = x.to(device), y.to(device)\n"
         "    return x, y\nfor it in range(10):\n    x, y = get_batch()\n    loss = model(x, y)\n"
         "    loss.backward()\n", {(4, "6")}),
        # deprecated amp spellings; a checkpoint without the scaler's scale
        ("import torch\nscaler = torch.cuda.amp.GradScaler()\nfor epoch in range(3):\n"
         "    for x in loader:\n        with torch.autocast('cuda'):\n            loss = model(x)\n"
         "        scaler.scale(loss).backward()\n    torch.save({'model': m.state_dict(), "
         "'optimizer': o.state_dict(), 'epoch': epoch, 'rng': r}, 'c')\n", {(2, "7"), (8, "checkpoints")}),
        # Accelerate's two habits that turn wrong in a ported loop
        ("total = steps * accelerator.num_processes\nif accelerator.is_main_process:\n"
         "    accelerator.save_state('out')\n", {(1, "migration"), (3, "checkpoints")}),
        # clipping before unscale_: the threshold meets the scaled gradients
        ("import torch\nscaler = torch.amp.GradScaler()\nfor x in loader:\n    with torch.autocast('cuda'):\n"
         "        loss = model(x)\n    scaler.scale(loss).backward()\n"
         "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    scaler.unscale_(opt)\n",
         {(7, "7")}),
    ],
    ids=[
        "eval-batches", "type-cuda", "append-under-interval", "helper-copy", "amp-and-scaler", "accelerate",
        "clip-before-unscale",
    ],
)
def test_what_each_rule_finds_in_the_forms_scripts_use(source: str, expected: set[tuple[int, str]]) -> None:
    found = {(f.line, f.topic) for f in lint_source(source) if "trains in fp32" not in f.message}
    assert found == expected, found


def test_the_diff_leaves_a_loader_that_is_already_right() -> None:
    source = (
        "from torch.utils.data import DataLoader\n"
        "fast = DataLoader(ds, batch_size=8, num_workers=4, persistent_workers=True)\n"
        "slow = DataLoader(ds, batch_size=8)\n"
    )
    after = rewrite_source(source)
    assert "fast = DataLoader(ds, batch_size=8, num_workers=4" in after and "slow = fast_loader(ds" in after
