"""Shared test setup: skip markers, and guards that fail a test which leaks global state."""

from __future__ import annotations

import os

import pytest
import torch

# Worker scripts run under torchrun; importing them (pytest --doctest-modules) would start their job.
collect_ignore = ["workers", "lint/scripts"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _env() -> dict[str, str]:
    # pytest's own variable, and the cache directory torch's lazily imported modules set for themselves.
    ignored = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
    return {k: v for k, v in os.environ.items() if k not in ignored}


@pytest.fixture(autouse=True)
def _no_leaked_global_state():
    """Fail a test that leaves a process group, an environment variable or a changed torch setting behind."""
    env_before = _env()
    threads_before = torch.get_num_threads()
    grad_before = torch.is_grad_enabled()
    yield
    leaked = []
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        leaked.append("an initialised torch.distributed process group")
    if _env() != env_before:
        changed = sorted(set(_env().items()) ^ set(env_before.items()))
        for key in set(_env()) - set(env_before):
            del os.environ[key]
        os.environ.update(env_before)
        leaked.append(f"environment changes {changed}")
    if torch.get_num_threads() != threads_before:
        torch.set_num_threads(threads_before)
        leaked.append("torch.set_num_threads")
    if torch.is_grad_enabled() != grad_before:
        torch.set_grad_enabled(grad_before)
        leaked.append("grad mode")
    if leaked:
        pytest.fail("test leaked " + "; ".join(leaked))


@pytest.fixture
def fresh_dynamo():
    """torch.compile's caches reset after the test, and the variables inductor sets for itself once per
    process at its first use dropped (the leak check above would blame the test that happened to be first)."""
    before = set(os.environ)
    yield
    torch.compiler.reset()
    for key in set(os.environ) - before:
        if key.startswith("_TORCHINDUCTOR_"):
            del os.environ[key]
