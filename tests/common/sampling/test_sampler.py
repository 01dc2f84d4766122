"""Device sampling: greedy, temperature, top-k, top-p, and per-request seeds that ignore batch composition."""

from __future__ import annotations

import torch

from common.sampling.sampler import logprobs_of, sample, splitmix64, uniform_noise


def _params(batch: int, temperature=1.0, top_p=1.0, top_k=0, seed=0, step=0):
    def full(value, dtype):
        return torch.full((batch,), value, dtype=dtype)

    return (
        full(temperature, torch.float32),
        full(top_p, torch.float32),
        full(top_k, torch.int64),
        full(seed, torch.int64),
        full(step, torch.int64),
    )


def test_splitmix64_known_values() -> None:
    # Reference outputs of the splitmix64 finaliser for inputs 0 and 1 (computed with Python ints mod 2**64).
    def ref(x: int) -> int:
        m = (1 << 64) - 1
        x = (x + 0x9E3779B97F4A7C15) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)

    values = [0, 1, 12345, 2**62 + 7, -5]
    got = splitmix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [ref(v & ((1 << 64) - 1)) for v in values]


def test_greedy_is_argmax() -> None:
    logits = torch.randn(4, 50)
    out = sample(logits, *_params(4, temperature=0.0))
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(6, 100)
    assert torch.equal(sample(logits, *_params(6, top_k=1, seed=3)), logits.argmax(-1))
    assert torch.equal(sample(logits, *_params(6, top_p=1e-6, seed=3)), logits.argmax(-1))


def test_top_k_restricts_support() -> None:
    logits = torch.randn(1, 30).expand(2000, -1).contiguous()
    temperature, top_p, top_k, _, _ = _params(2000, top_k=3)
    seeds = torch.arange(2000, dtype=torch.int64)
    out = sample(logits, temperature, top_p, top_k, seeds, torch.zeros(2000, dtype=torch.int64))
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(out.tolist()) == allowed


def test_top_p_restricts_support() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].expand(4000, -1).contiguous()
    temperature, _, top_k, _, steps = _params(4000)
    out = sample(logits, temperature, torch.full((4000,), 0.7), top_k, torch.arange(4000), steps)
    assert set(out.tolist()) == {0, 1}  # 0.5 < 0.7 so the second token is needed; 0.8 ≥ 0.7 stops there


def test_samples_follow_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    n = 20000
    logits = probs.log()[None].expand(n, -1).contiguous()
    temperature, top_p, top_k, _, steps = _params(n)
    out = sample(logits, temperature, top_p, top_k, torch.arange(n), steps)
    freq = torch.bincount(out, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015), freq


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(5000, -1).contiguous()
    _, top_p, top_k, _, steps = _params(5000)
    seeds = torch.arange(5000)
    cold = sample(logits, torch.full((5000,), 0.25), top_p, top_k, seeds, steps)
    hot = sample(logits, torch.full((5000,), 2.0), top_p, top_k, seeds, steps)
    assert (cold == 0).float().mean() > (hot == 0).float().mean() + 0.3


def test_seed_is_reproducible_and_independent_of_batch() -> None:
    logits = torch.randn(3, 64)
    params = _params(3, seed=0)
    seeds = torch.tensor([11, 22, 33])
    steps = torch.tensor([0, 5, 9])
    together = sample(logits, params[0], params[1], params[2], seeds, steps)
    alone = [
        sample(logits[i : i + 1], *[p[i : i + 1] for p in params[:3]], seeds[i : i + 1], steps[i : i + 1])
        for i in range(3)
    ]
    assert together.tolist() == [a.item() for a in alone]
    again = sample(logits, params[0], params[1], params[2], seeds, steps)
    assert torch.equal(together, again)


def test_noise_changes_with_seed_and_step() -> None:
    base = uniform_noise(torch.tensor([1]), torch.tensor([0]), 1000)
    assert base.min() > 0 and base.max() < 1
    assert not torch.equal(base, uniform_noise(torch.tensor([2]), torch.tensor([0]), 1000))
    assert not torch.equal(base, uniform_noise(torch.tensor([1]), torch.tensor([1]), 1000))
    assert abs(base.mean().item() - 0.5) < 0.05


def test_top_p_zero_keeps_only_the_most_likely_token() -> None:
    logits = torch.tensor([[0.1, 2.0, 1.9, -1.0]] * 64)
    rows = torch.arange(64)
    picked = sample(
        logits,
        torch.ones(64),
        torch.zeros(64),
        torch.zeros(64, dtype=torch.int64),
        rows,  # 64 seeds: a sampler that kept more than the top token would pick another somewhere
        torch.zeros(64, dtype=torch.int64),
    )
    assert picked.tolist() == [1] * 64


def test_logprobs_are_the_models_log_softmax_before_temperature() -> None:
    logits = torch.randn(3, 50, dtype=torch.bfloat16)
    tokens = torch.tensor([4, 0, 49])
    chosen, values, ids = logprobs_of(logits, tokens, 5)
    want = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(chosen, want[torch.arange(3), tokens])
    torch.testing.assert_close(values, want.sort(dim=-1, descending=True).values[:, :5])
    assert torch.equal(want.gather(1, ids), values) and chosen.dtype == torch.float32
    assert logprobs_of(logits, tokens, 0)[1].shape == (3, 0)
