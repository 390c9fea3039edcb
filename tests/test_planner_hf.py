"""The planner on a Hugging Face model that is no layer list: its measure must not trip on
what the model returns beside its logits (GPT-2's key-value cache, a ``DynamicCache``,
which a pipeline stage could not pass on: the split backward's measure, which needs a
layer list, once ran on the whole model and refused every candidate)."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.losses import causal_lm_cross_entropy

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face models need transformers (pip install transformers)"
)

VOCAB, LENGTH = 64, 16


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def test_a_hugging_face_gpt2_is_predicted_under_dp(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    ids = torch.randint(0, VOCAB, (4, LENGTH), generator=torch.Generator().manual_seed(0))
    plan = paratrain.predict(
        _gpt2(),
        strategy="dp",
        devices=2,
        global_batch=4,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-4),
        loss_fn=causal_lm_cross_entropy,
        sample=({"input_ids": ids}, ids.clone()),
    )
    assert plan.predicted_peak_bytes > sum(p.numel() * 4 for p in _gpt2().parameters())
    assert plan.predicted_step_s > 0
