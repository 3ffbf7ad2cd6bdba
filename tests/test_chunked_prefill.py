"""Chunked prefill computes exactly what a full prefill computes (the paper's Figure 6)."""
import pytest
import torch

from charioteer import LLM, SamplingParams
from texts import prompt_ids

PROMPT_LEN = 300


def run_prompt(model, ids, **engine_kwargs):
    """Prompt logprobs and the last position's logits for one prompt."""
    llm = LLM(model, **engine_kwargs)
    captured = []
    forward = llm.engine.model.forward

    def recording_forward(inp, kv, hooks=None):
        logits = forward(inp, kv, hooks)
        captured.append(logits.clone())
        return logits

    llm.engine.model.forward = recording_forward
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))[0]
    return out.prompt_logprobs, captured[-1][-1], llm.engine.num_steps


@pytest.fixture(scope="module")
def prompt(default_model):
    return prompt_ids(default_model.tokenizer, PROMPT_LEN, offset=11)


@pytest.fixture(scope="module")
def full(default_model, prompt):
    # Orca runs the whole prompt in one pass.
    logprobs, logits, steps = run_prompt(default_model, prompt, scheduler="orca")
    assert steps == 1
    return logprobs, logits


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 256])
def test_chunked_equals_full_prefill(default_model, prompt, full, chunk_size):
    full_logprobs, full_logits = full
    logprobs, logits, steps = run_prompt(default_model, prompt, scheduler="sarathi", chunk_size=chunk_size)
    assert steps == -(-PROMPT_LEN // chunk_size)
    assert len(logprobs) == len(full_logprobs) == PROMPT_LEN
    assert logprobs[0] is None and full_logprobs[0] is None
    worst = 0.0
    for pos in range(1, PROMPT_LEN):
        token = prompt[pos]
        assert token in logprobs[pos] and token in full_logprobs[pos]
        for tok, value in full_logprobs[pos].items():
            if tok in logprobs[pos]:
                worst = max(worst, abs(logprobs[pos][tok] - value))
        # The top-5 set is the same unless two candidates tie within tolerance.
        ranked = sorted(full_logprobs[pos].values(), reverse=True)
        if len(ranked) >= 6 and ranked[4] - ranked[5] > 1e-4:
            assert set(logprobs[pos]) == set(full_logprobs[pos])
    assert worst < 1e-4, f"prompt logprobs differ by {worst}"
    diff = (logits - full_logits).abs().max().item()
    assert diff < 1e-4, f"last-position logits differ by {diff}"
    assert torch.equal(logits.argmax(), full_logits.argmax())
