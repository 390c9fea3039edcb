"""num_items_in_batch for a Hugging Face model's own loss (parallel/model_loss_items.py):
which models take it, the count (shifted as their causal loss shifts), and the notice
where a model does not take it. The engines' parity with it is in tests/test_hf_models.py
(``test_the_models_own_loss_is_the_global_token_mean_under_dp_zero2_and_the_pipeline``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.losses import causal_lm_cross_entropy
from paratrain.parallel import model_loss_items
from tests import hf_workers

pytest.importorskip("transformers", reason="the dev extra installs transformers")


class OwnLoss(nn.Module):
    """A model computing its own mean loss, with no num_items_in_batch."""

    def forward(self, input_ids, labels=None):
        return input_ids.float().mean()


def batch() -> dict:
    labels = torch.tensor([[5, 6, -100, -100], [-100, 7, 8, 9]])
    return {"input_ids": labels.clamp(min=0), "labels": labels}


def test_the_count_is_the_shifted_labels_and_goes_to_models_that_take_it():
    llama = hf_workers.build("llama")
    assert model_loss_items.takes_num_items(llama)
    assert not model_loss_items.takes_num_items(OwnLoss())
    assert model_loss_items.labelled_tokens(batch()) == 4  # position 0 predicts nothing
    assert model_loss_items.with_num_items(llama, batch(), 2, lambda o, _: o.loss) == 4
    part = model_loss_items.part_inputs(batch(), 4, 2)
    assert float(part["num_items_in_batch"]) == 2.0


def test_a_model_that_does_not_take_it_is_named_once_with_the_exact_loss(capsys):
    model_loss_items._SAID.discard("OwnLoss")
    for _ in range(2):
        assert model_loss_items.with_num_items(OwnLoss(), batch(), 2, lambda o, _: o) is None
    said = capsys.readouterr().err
    assert said.count("OwnLoss.forward takes no num_items_in_batch") == 1, said
    assert "causal_lm_cross_entropy is exact" in said
    model_loss_items._SAID.discard("OwnLoss")
    model_loss_items.with_num_items(OwnLoss(), batch(), 2, causal_lm_cross_entropy)
    assert capsys.readouterr().err == ""  # a (sum, count) loss is exact: nothing to say
