"""Engine core (scheduler + runner, no HTTP): exactness of continuous batching and logprobs,
stop conditions, weight loading."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rollout_fleet.engine.requests import ModelLimits, expand_generate
from rollout_fleet.engine.runner import ModelRunner, WeightLoadError
from rollout_fleet.engine.scheduler import Scheduler, Sequence
from rollout_fleet.protocol import GenerateRequest, SamplingParams

SHARPEN = 30.0
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20], [21, 22], [7, 7, 7, 7]]


class Harness:
    def __init__(self, model_dir, max_running_requests: int = 8) -> None:
        torch.set_num_threads(1)
        self.runner = ModelRunner(model_dir)
        self.scheduler = Scheduler(self.runner, max_running_requests=max_running_requests)
        self.scheduler.start()
        self.limits = ModelLimits(
            self.runner.vocab_size,
            self.runner.max_context,
            frozenset(self.runner.eos_token_ids),
            self.runner.device,
        )

    def submit(self, prompt, **params) -> tuple[list[Sequence], threading.Event]:
        done = threading.Event()
        seqs: list[Sequence] = []

        def on_event(seq: Sequence, finished: bool) -> None:
            if finished and all(s.finished for s in seqs):
                done.set()

        req = GenerateRequest(input_ids=prompt, sampling_params=SamplingParams(**params))
        items, _ = expand_generate(req, self.runner.tokenizer, self.limits, on_event)
        seqs.extend(s for s, _ in items)
        self.scheduler.submit(seqs).result(10)
        return seqs, done

    def close(self) -> None:
        self.scheduler.stop()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    # eos_token_id outside the vocabulary: never stop, never suppress EOS (= ignore_eos).
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=10**6,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch_fixture", ["tiny_model_dir", "tiny_llama_dir"])
def test_greedy_equals_hf_generate_with_requests_joining_at_different_times(arch_fixture, request):
    h = Harness(request.getfixturevalue(arch_fixture), max_running_requests=3)
    # Random tiny models have near-flat logits (top-2 gaps down to ~5e-4), where float rounding
    # of different batch shapes could flip an argmax; sharpen them so the comparison tests the
    # engine, not float noise.
    with torch.no_grad():
        h.runner.model.lm_head.weight.mul_(SHARPEN)
    try:
        lengths = [24, 9, 17, 30, 12]
        submitted = []
        for prompt, n in zip(PROMPTS, lengths, strict=True):
            submitted.append(h.submit(prompt, temperature=0.0, max_new_tokens=n, ignore_eos=True))
            # Let the batch decode a few steps so the next request joins mid-flight.
            first = submitted[0][0][0]
            deadline = time.monotonic() + 5
            while len(first.output_ids) < 3 * len(submitted) and not first.finished:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.001)
        for (seqs, done), prompt, n in zip(submitted, PROMPTS, lengths, strict=True):
            assert done.wait(30)
            assert seqs[0].output_ids == hf_greedy(h.runner.model, prompt, n)
            assert seqs[0].finish_reason == {"type": "length", "length": n}
    finally:
        h.close()


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}])
def test_reported_logprobs_equal_a_recomputed_forward_pass(tiny_model_dir, params):
    h = Harness(tiny_model_dir)
    try:
        runs = [h.submit(p, max_new_tokens=16, ignore_eos=True, n=2, **params) for p in PROMPTS[:3]]
        for (seqs, done), prompt in zip(runs, PROMPTS[:3], strict=True):
            assert done.wait(30)
            for seq in seqs:
                full = h.runner.full_logprobs(prompt + seq.output_ids, params["temperature"])
                positions = torch.arange(len(prompt) - 1, len(prompt) + len(seq.output_ids) - 1)
                expected = full[positions, torch.tensor(seq.output_ids)]
                assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=1e-4)
                assert seq.versions == [0] * len(seq.output_ids)
    finally:
        h.close()


def test_stop_token_ids_and_stop_strings_end_a_sequence(tiny_model_dir):
    h = Harness(tiny_model_dir)
    try:
        reference = hf_greedy(h.runner.model, PROMPTS[0], 12)
        stop_token = reference[4]
        seqs, done = h.submit(
            PROMPTS[0],
            temperature=0.0,
            max_new_tokens=12,
            stop_token_ids=[stop_token],
            ignore_eos=True,
        )
        assert done.wait(30)
        first = reference.index(stop_token)
        assert seqs[0].output_ids == reference[: first + 1]
        assert seqs[0].finish_reason == {"type": "stop", "matched": stop_token}
        stop_text = h.runner.tokenizer.decode(reference[2:4])
        seqs, done = h.submit(
            PROMPTS[0], temperature=0.0, max_new_tokens=12, stop=stop_text, ignore_eos=True
        )
        assert done.wait(30)
        assert seqs[0].finish_reason == {"type": "stop", "matched": stop_text}
        assert stop_text in h.runner.tokenizer.decode(seqs[0].output_ids)
        assert len(seqs[0].output_ids) <= 4
    finally:
        h.close()


def test_max_running_requests_caps_the_batch_and_queues_the_rest(tiny_model_dir):
    h = Harness(tiny_model_dir, max_running_requests=2)
    try:
        runs = [h.submit(p, temperature=0.0, max_new_tokens=20, ignore_eos=True) for p in PROMPTS]
        peak = 0
        while not all(done.is_set() for _, done in runs):
            peak = max(peak, h.scheduler.load()["num_running_reqs"])
            time.sleep(0.001)
        assert peak <= 2
        for (seqs, _), prompt in zip(runs, PROMPTS, strict=True):
            assert seqs[0].output_ids == hf_greedy(h.runner.model, prompt, 20)
    finally:
        h.close()


def test_load_weights_copies_by_name_and_rejects_mismatches(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir)
    before = {k: v.clone() for k, v in runner.model.state_dict().items()}
    name = "model.norm.weight"
    new = torch.full_like(runner.named_weights()[name], 0.5)
    assert runner.load_weights([(name, new)]) == 1
    after = runner.model.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == [name]
    assert torch.equal(after[name], new)
    assert runner.weight_rows(name, 3) == new[:3].tolist()  # /get_weights_by_name's reply
    assert runner.weight_rows("model.nope.weight", 3) is None
    with pytest.raises(WeightLoadError, match="not a parameter"):
        runner.load_weights([("model.nope.weight", new)])
    with pytest.raises(WeightLoadError, match="shape"):
        runner.load_weights([(name, torch.zeros(3))])
    assert torch.equal(runner.model.state_dict()[name], new)
