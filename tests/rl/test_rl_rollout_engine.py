"""The rollout engine: cached, forked, multi-turn generation records the same logprobs and experts a
full forward of the finished sequence computes (so the learner's ratio starts at 1)."""
import torch

from policy import build_model
from rl.rollout.engine import TorchEngine, sample_token


def test_recorded_logprobs_and_routing_match_a_full_forward():
    torch.manual_seed(0)
    model = build_model("toy", vocab_size=300).eval()
    engine = TorchEngine(model, record_routing=True, seed=1)
    prompt = torch.randint(10, 300, (12,)).tolist()
    engine.start(prompt, 3)
    first = engine.generate_turn([0, 1, 2], 6, stop_ids={7}, temperature=1.0, top_p=1.0)
    # Rows diverge: row 1 gets a tool result of 5 tokens, row 2 of 2, row 0 stops.
    engine.extend(1, [11, 12, 13, 14, 15])
    engine.extend(2, [21, 22])
    engine.generate_turn([1, 2], 5, stop_ids={7}, temperature=1.0, top_p=1.0)
    assert all(len(first[i].new_tokens) >= 1 for i in range(3))
    for i, row in enumerate(engine.rows):
        ids = torch.tensor([row.tokens])
        routing = torch.from_numpy(engine.routing_array(i, len(row.tokens)).astype("int64"))[None]
        with torch.no_grad():
            full = model(ids, routing=routing, return_token_logprobs=True).token_logprobs[0]  # the learner's path
            free = model(ids, return_routing=True)
        mask = torch.tensor(row.loss_mask, dtype=torch.bool)
        assert mask.sum() > 0
        torch.testing.assert_close(full[mask], torch.tensor(row.logprobs)[mask], atol=2e-4, rtol=0)
        fed = len(row.routing)  # the last sampled token is never fed to the model
        assert torch.equal(free.routing[0, :fed], routing[0, :fed])


def test_top_p_samples_only_from_the_nucleus_and_reports_its_logprob():
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]]).repeat(400, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample_token(logits, temperature=1.0, top_p=0.7, generator=gen)
    assert set(tokens.tolist()) <= {0, 1}
    nucleus = torch.softmax(torch.tensor([3.0, 2.0]), -1).log()
    torch.testing.assert_close(logp, nucleus[tokens])
    greedy, _ = sample_token(logits[:1], temperature=0.0, top_p=1.0, generator=gen)
    assert greedy.item() == 0
