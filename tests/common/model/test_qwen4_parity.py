"""qwen4_exp (Qwen3.8-Flash-Next's text model) against transformers, in float32 on CPU.

Tiny random configs with PLE on and off, prompts shorter and longer than the QSA indexer's dense range
(budget + ratio − 1 tokens), a batch of unequal lengths, chunked prefill, 16 decode steps, 32 greedy tokens.
The indexer sums ReLU scores over its heads; with few heads, exact zero scores tie often and the choice among
tied blocks is arbitrary (torch.topk's, in transformers as here), so these configs use 16 indexer heads.
"""

from __future__ import annotations

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-4
BASE = {"indexer_n_heads": 16, "indexer_budget": 16, "indexer_compress_ratio": 4}  # dense up to 19 tokens
CASES = {
    "ple": {},
    "no-ple": {"ple_layer_ids": []},
    "gqa1-tied-topk3": {
        "num_key_value_heads": 1,
        "num_experts_per_tok": 3,
        "num_experts": 7,
        "tie_word_embeddings": True,
    },
    "8-layers-budget8": {"num_hidden_layers": 8, "indexer_budget": 8, "linear_num_value_heads": 2},
}
PROMPT_LENS = (7, 45, 19, 30)  # dense, sparse, at the dense limit, sparse


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    make_model(out, preset="tiny", arch="qwen4_exp", overrides={**BASE, **CASES[request.param]}, seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    )
    return out, hf.eval()


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    prompts[3][10] = prompts[3][20] = 2  # EOS inside a prompt: n-gram context restarts there
    return prompts


@torch.inference_mode()
@pytest.mark.parametrize("chunk", [None, 6], ids=["one-pass", "chunked"])
def test_logits_match_transformers(checkpoint, chunk, matches_transformers):
    model_dir, hf = checkpoint
    engine = Engine(WorkerConfig(str(model_dir), max_running=4, max_context=96))
    runner = engine.runner
    prompts = _prompts(engine.config.vocab_size)
    seqs = [runner.new_sequence() for _ in prompts]
    if chunk is None:
        ours = runner.forward(seqs, prompts, all_logits=True)
    else:  # every sequence prefilled `chunk` tokens at a time, all in each pass
        per_seq = [[] for _ in prompts]
        for start in range(0, max(PROMPT_LENS), chunk):
            live = [b for b, p in enumerate(prompts) if start < len(p)]
            out = runner.forward(
                [seqs[b] for b in live], [prompts[b][start : start + chunk] for b in live], True
            )
            offset = 0
            for b in live:
                n = len(prompts[b][start : start + chunk])
                per_seq[b].append(out[offset : offset + n])
                offset += n
        ours = torch.cat([torch.cat(p) for p in per_seq])

    matches_transformers(runner, hf, seqs, prompts, ours, 16, REL_TOL)


@torch.inference_mode()
def test_indexer_scores_in_query_slices(checkpoint, matches_transformers, monkeypatch):
    """A long prefill scores its queries against the blocks in slices (`QSAIndexer.score_bytes`): here one
    query per slice, still transformers' logits."""
    from common.model.qwen4_exp.qsa import QSAIndexer

    monkeypatch.setattr(QSAIndexer, "score_bytes", 1)
    model_dir, hf = checkpoint
    runner = Engine(WorkerConfig(str(model_dir), max_running=4, max_context=96)).runner
    prompts = _prompts(runner.model.config.vocab_size)
    seqs = [runner.new_sequence() for _ in prompts]
    ours = runner.forward(seqs, prompts, all_logits=True)
    matches_transformers(runner, hf, seqs, prompts, ours, 16, REL_TOL)


@torch.inference_mode()
def test_greedy_generation_matches_transformers(checkpoint):
    model_dir, hf = checkpoint
    engine = Engine(WorkerConfig(str(model_dir), max_running=3, max_context=96))
    prompts = _prompts(engine.config.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours = engine.generate(prompts, params)
    hf.generation_config.eos_token_id = None
    for prompt, result in zip(prompts, ours, strict=True):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, pad_token_id=0)
        assert result.token_ids == ref[0, len(prompt) :].tolist()
