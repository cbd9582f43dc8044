"""Fixtures of the profiling tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture
def model() -> nn.Module:
    """A seeded ``nn.Linear(8, 4)``: the model the profiled and checked loops train."""
    torch.manual_seed(0)
    return nn.Linear(8, 4)
