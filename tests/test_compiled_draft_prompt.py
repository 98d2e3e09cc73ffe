"""A feature draft's catch-up over a short prompt on the compiled path: run as compiled K+1-row steps
(the KV state carried from chunk to chunk) instead of one eager call. Checked by what depends on it:
the speculative output equals eager target-only greedy, the draft accepts as well as the eager
draft on the same prompt (a broken context would propose poorly), and the chunked call returns one
call's shapes with the logits of the asked row."""
import pytest
import torch

from builder import embedded
from runtime.generation import generate
from runtime.loading import open_checkpoint
from runtime.speculative import speculative_generate
from tests.tolerances import assert_within, gamma

PROMPT = [(i * 53) % 1900 + 7 for i in range(13)]   # 13 rows: chunks of 5, 5 and 3 (padded)


@pytest.fixture(scope="module")
def models():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target, draft = embedded.target_dir(), embedded.draft_dir("eagle3")
    yield (open_checkpoint(target, mode="eagle3", draft_dir=draft, backend="torch"),
           open_checkpoint(target, mode="eagle3", draft_dir=draft, backend="compiled"))
    torch.set_num_threads(threads)


def test_short_prompt_context_runs_as_compiled_steps(models, monkeypatch):
    eager, comp = models
    want = generate(eager.runner, [PROMPT], 24).output_ids
    eager_run = speculative_generate(eager.runner, eager.proposer(), [PROMPT], 24, 4)
    proposer = comp.proposer()
    chunks = []
    original = type(proposer.draft)._prompt_chunks
    monkeypatch.setattr(type(proposer.draft), "_prompt_chunks",
                        lambda self, feeds: (chunks.append(feeds["input_ids"].shape[1]), original(self, feeds))[1])
    for _ in range(2):   # the second run through compiled draft steps
        got = speculative_generate(comp.runner, proposer, [PROMPT], 24, 4)
        assert got.output_ids == want
    assert chunks == [len(PROMPT) - 1] * 2, "the prompt's context went through the chunked path"
    assert any(key[1][0][1][0] == proposer.draft.pad_to for key in proposer.draft._steps.ready), \
        "the K+1-row draft step ran compiled"
    accepted = got.extra["acceptance"]["mean_accepted_tokens"]
    assert accepted > 1.5 and accepted >= eager_run.extra["acceptance"]["mean_accepted_tokens"] - 0.3


def test_chunked_call_returns_one_calls_outputs(models):
    """Every row's hidden state, the logits of ``logit_index``'s row (in the middle chunk here) and
    the state, shaped as one call's, and near the eager call's: the same math summed in other orders
    (sums of at most 576 terms, gamma_576 of their magnitude each, through a few products in a row:
    8 gamma_576 of the largest value), far below what a wrong row, position or state moves."""
    _, comp = models
    draft = comp.proposer().draft
    rows = 12
    g = torch.Generator().manual_seed(5)
    state = draft.new_state(1, 64)
    feeds = {"input_ids": torch.tensor([PROMPT[:rows]], dtype=torch.int32),
             "positions": torch.arange(rows, dtype=torch.int32)[None],
             "lengths": torch.tensor([rows], dtype=torch.int32),
             "logit_index": torch.tensor([[7]], dtype=torch.int32),
             "aux_hidden": torch.randn(1, rows, 576, generator=g), "hidden": torch.randn(1, rows, 192, generator=g),
             "from_target": torch.ones(1, rows, dtype=torch.int32),
             **{"past." + k: v for k, v in state.items()}}
    want = draft.components["draft"].call(feeds)
    got = draft.run("draft", feeds)
    assert set(got) == set(want)
    assert all(got[k].shape == want[k].shape for k in want)
    for name in ("logits", "hidden_out"):
        bound = 8 * gamma(576) * want[name].abs().max()
        assert_within(got[name], want[name], bound, f"chunked {name}")
