"""PLE's n-gram hashing equals transformers' for random id sequences, EOS segment boundaries included."""

from __future__ import annotations

import pytest
import torch

from common.model.ngram import NGramSpec, ngram_ids

qwen4 = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
config_mod = pytest.importorskip("transformers.models.qwen4_exp.configuration_qwen4_exp")

EOS = 2


def _hf_embedding(ple_index: int, vocab: int = 1024, base: int = 1000, heads_per_ngram: int = 8):
    cfg = config_mod.Qwen4ExpTextConfig(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=4,
        ple_layer_ids=[2, 3],
        ple_embed_dim=64,
        ngram_vocab_size_base=base,
        heads_per_ngram=heads_per_ngram,
        eos_token_id=EOS,
        seed=99,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    module = qwen4.Qwen4ExpTextNGramEmbedding(cfg, embedding_dim=64, layer_idx=1, ple_layer_index=ple_index)
    rows = module.ngram_embedding.weight.shape[0]
    with torch.no_grad():  # each row holds its own index: the embedding output reveals the ids
        module.ngram_embedding.weight.copy_(torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 4))
    spec = NGramSpec.build(vocab, 3, heads_per_ngram, base, 128, 99, ple_index, EOS)
    return module, spec


@pytest.mark.parametrize("ple_index", [0, 1])
def test_parameters_equal_transformers(ple_index: int) -> None:
    module, spec = _hf_embedding(ple_index)
    assert list(spec.multipliers) == module.layer_multipliers.tolist()
    assert list(spec.head_vocab_sizes) == module.ngram_heads_vocab_sizes.tolist()
    assert list(spec.head_offsets) == module.ngram_heads_offsets.tolist()
    assert spec.table_rows == module.ngram_embedding.weight.shape[0]


@pytest.mark.parametrize("seed", range(6))
def test_ids_equal_transformers(seed: int) -> None:
    module, spec = _hf_embedding(ple_index=seed % 2)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1024, (3, 40), generator=g)
    eos_at = torch.rand(3, 40, generator=g) < 0.15  # EOS anywhere: first token, runs of EOS, last token
    tokens[eos_at] = EOS
    tokens[0, 0] = tokens[1, 5] = tokens[1, 6] = tokens[2, -1] = EOS
    with torch.no_grad():
        ref = module(tokens, cache=None).view(3, 40, spec.num_heads, 4)[..., 0].long()
    history = torch.cat([torch.full((3, 2), EOS), tokens], dim=1)  # a fresh sequence starts after EOS
    assert torch.equal(ngram_ids(spec, history, 40), ref)


def test_ids_continue_across_chunks() -> None:
    """Hashing a sequence in pieces, carrying the last two ids, equals hashing it whole."""
    _, spec = _hf_embedding(ple_index=0)
    tokens = torch.randint(0, 1024, (1, 30), generator=torch.Generator().manual_seed(7))
    tokens[0, 11] = EOS
    whole = ngram_ids(spec, torch.cat([torch.full((1, 2), EOS), tokens], dim=1), 30)
    context, parts = torch.full((1, 2), EOS), []
    for a, b in [(0, 1), (1, 12), (12, 13), (13, 30)]:
        history = torch.cat([context, tokens[:, a:b]], dim=1)
        parts.append(ngram_ids(spec, history, b - a))
        context = history[:, -2:]
    assert torch.equal(torch.cat(parts, dim=1), whole)
