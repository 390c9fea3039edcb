"""The planner on a Hugging Face model that is no layer list: its measure must not trip on
what the model returns beside its logits (GPT-2's key-value cache, a ``DynamicCache``,
which a pipeline stage could not pass on: the split backward's measure, which needs a
layer list, once ran on the whole model and refused every candidate)."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.losses import causal_lm_cross_entropy
from tests import hf_workers

pytest.importorskip(
    "transformers", reason="the Hugging Face models need transformers (pip install transformers)"
)


def test_a_hugging_face_gpt2_is_predicted_under_dp(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    vocab, length = hf_workers.VOCAB, hf_workers.LENGTH
    ids = torch.randint(0, vocab, (4, length), generator=torch.Generator().manual_seed(0))
    plan = paratrain.predict(
        hf_workers.build("gpt2"),
        strategy="dp",
        devices=2,
        global_batch=4,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-4),
        loss_fn=causal_lm_cross_entropy,
        sample=({"input_ids": ids}, ids.clone()),
    )
    parameters = sum(p.numel() * 4 for p in hf_workers.build("gpt2").parameters())
    assert plan.predicted_peak_bytes > parameters
    assert plan.predicted_step_s > 0
