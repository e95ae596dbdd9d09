"""The scored tokens' log-probabilities against log-softmax over the whole logits."""

from __future__ import annotations

import pytest
import torch

from fastllm.evaluation import scoring


@pytest.mark.parametrize("budget", [scoring.LOGITS_BUDGET, 3 * 37])  # one chunk; 3 rows a chunk
def test_token_log_probs_are_log_softmax_and_argmax(
    budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scoring, "LOGITS_BUDGET", budget)
    generator = torch.Generator().manual_seed(0)
    hidden, weight = (
        torch.randn(10, 16, generator=generator),
        torch.randn(37, 16, generator=generator),
    )
    logits = hidden @ weight.T
    targets = torch.randint(0, 37, (10,), generator=generator)
    targets[::2] = logits.argmax(1)[::2]  # half of them the most likely token
    log_probs, greedy = scoring.token_log_probs(hidden, weight, targets)
    expected = torch.log_softmax(logits, 1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(log_probs, expected)
    assert greedy.tolist() == (logits.argmax(1) == targets).tolist()
    assert greedy[::2].all() and not greedy.all()
