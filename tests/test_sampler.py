"""The sampler's draw: the distribution it is given, never a token of probability 0, seeded runs repeat."""
import torch

from charioteer.engine.model_runner import draw


def test_draw_follows_the_distribution_and_skips_zero_probabilities():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(n)]), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    # within 4 standard deviations of n * p for every token
    for token, p in ((1, 0.5), (3, 0.3), (4, 0.2)):
        assert abs(counts[token] - n * p) < 4 * (n * p * (1 - p)) ** 0.5, (token, counts.tolist())


def test_draw_takes_unnormalised_weights_and_repeats_with_its_seed():
    weights = torch.tensor([2.0, 0.0, 6.0])  # 1/4 and 3/4
    first = [draw(weights, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert first == [draw(weights, torch.Generator().manual_seed(7)) for _ in range(3)]
    gen = torch.Generator().manual_seed(1)
    drawn = [draw(weights, gen) for _ in range(4000)]
    assert 1 not in drawn and abs(drawn.count(2) / 4000 - 0.75) < 0.03
