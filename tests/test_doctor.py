"""python -m speedups.doctor runs on a CPU-only machine and tells the truth about it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from speedups._helpers import hardware as _hardware
from speedups.doctor import diagnose, format_diagnosis
from tests._dist import ROOT


@pytest.mark.slow
def test_doctor_runs_as_a_module() -> None:
    cmd = [sys.executable, "-m", "speedups.doctor"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert f"torch {torch.__version__}" in out.stdout
    assert "What that means for each tip" in out.stdout and "mixed precision" in out.stdout


def test_diagnosis_matches_this_machine() -> None:
    d = diagnose()
    assert d["torch"] == torch.__version__
    assert len(d["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert d["usable_cpus"] == _hardware.usable_cpus() >= 1
    assert ("gloo" in d["distributed_backends"]) == torch.distributed.is_gloo_available()
    assert d["rank"] == 0 and d["world_size"] == 1


def test_precision_advice_follows_the_hardware() -> None:
    d = diagnose() | {"gpus": [], "mps": False}
    assert "stays in fp32" in format_diagnosis(d | {"cpu_native_bf16": False})
    assert "bf16 autocast on this CPU" in format_diagnosis(d | {"cpu_native_bf16": True})
    old_gpu = {"name": "T4", "memory_gib": 15.0, "capability": "7.5", "bf16": False}
    assert "fp16 autocast with loss scaling" in format_diagnosis(d | {"gpus": [old_gpu]})


def test_cpu_bf16_flag_parsing() -> None:
    assert not _hardware.bf16_in_cpuinfo("processor : 0\nflags : fpu avx2 fma\n")
    assert _hardware.bf16_in_cpuinfo("flags\t\t: avx2 avx512f avx512_bf16\n")
    assert _hardware.bf16_in_cpuinfo("flags : amx_bf16 amx_tile\n")
