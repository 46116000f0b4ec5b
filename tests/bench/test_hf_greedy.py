"""bench/hf_greedy.py on the CPU: the reference the GPU checks share keeps every asked-for
token, and its step logits are the ones that chose the tokens."""
import torch

from bench.hf_greedy import greedy_with_logits, load_reference


def test_every_token_is_kept_and_is_its_steps_argmax(tiny_llama_dir):
    model = load_reference(tiny_llama_dir, torch.float32, "cpu")
    prompts = [[1, 5, 9, 2], [3, 3, 3, 3, 3, 3, 7]]
    tokens, logits = greedy_with_logits(model, prompts, 12, "cpu")
    vocab = model.config.vocab_size
    assert [len(t) for t in tokens] == [12, 12]  # no eos stops it early
    assert [tuple(steps.shape) for steps in logits] == [(12, vocab), (12, vocab)]
    assert all(steps.dtype == torch.float32 and steps.device.type == "cpu" for steps in logits)
    assert [steps.argmax(-1).tolist() for steps in logits] == tokens


def test_the_step_logits_are_the_teacher_forced_ones(tiny_llama_dir):
    model = load_reference(tiny_llama_dir, torch.float32, "cpu")
    ids = [1, 5, 9, 2, 11]
    tokens, logits = greedy_with_logits(model, [ids], 6, "cpu")
    with torch.inference_mode():
        forced = model(torch.tensor([ids + tokens[0][:-1]])).logits[0, len(ids) - 1:].float()
    torch.testing.assert_close(logits[0], forced, atol=1e-4, rtol=1e-4)
