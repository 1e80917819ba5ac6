"""sampling.generate, the one generate call of every sampler: the model's mode restored, the completion mask by hand, seeds."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from evaluation import sampling


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    return LlamaForCausalLM(config)


def test_the_completion_mask_keeps_tokens_up_to_and_including_the_first_stop():
    completions = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [3, 5, 9, 9]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)  # stops: 2 and 9
    assert torch.equal(sampling.completion_mask(completions, [2, 9]), expected)


@pytest.mark.parametrize("training", [True, False])
def test_generate_restores_the_mode_it_found(model, training):
    model.train(training)
    ids, mask = torch.tensor([[0, 4, 5]]), torch.tensor([[0, 1, 1]])
    sampling.generate(model, ids, mask, [1], pad_token_id=0, max_new_tokens=3, do_sample=False)
    assert model.training is training


def test_a_seed_gives_the_same_samples_and_greedy_is_the_argmax(model):
    ids, mask = torch.tensor([[4, 5, 6]]), torch.tensor([[1, 1, 1]])

    def draw():
        return sampling.generate(model, ids, mask, [1], pad_token_id=0, seed=3, max_new_tokens=4, do_sample=True)[0]

    assert torch.equal(draw(), draw())
    greedy, _ = sampling.generate(model, ids, mask, [31], pad_token_id=0, max_new_tokens=1, do_sample=False)
    with torch.no_grad():
        assert greedy[0, 0] == model(input_ids=ids).logits[0, -1].argmax()
