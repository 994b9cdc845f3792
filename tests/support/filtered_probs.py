"""The sampling tests' reference distribution: a row's probabilities after a request's
temperature, top-k and top-p, computed directly in float64 (tests/examples/engine/test_sampler.py,
test_rejection_sampler.py, test_draft_model.py)."""

from __future__ import annotations

import torch

from examples.engine import SamplingParams


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probability of each token, in vocabulary order, after temperature, top-k, top-p."""
    ordered, order = (logits.double() / params.temperature).sort(descending=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if 0 < params.top_k < len(logits):
        keep[params.top_k:] = False
    probs = ordered.masked_fill(~keep, -torch.inf).softmax(dim=0)
    keep &= (probs.cumsum(dim=0) - probs) <= params.top_p
    probs = ordered.masked_fill(~keep, -torch.inf).softmax(dim=0)
    return torch.zeros_like(probs).scatter(0, order, probs)
