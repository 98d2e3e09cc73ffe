"""The eager NemotronH against Hugging Face transformers (the oracle), fp32."""
import pytest
import torch
from transformers import NemotronHForCausalLM

from builder.checkpoint import load_checkpoint
from builder.models.nemotron_h import NemotronH
from runtime.generation import generate
from runtime.runner import TorchRunner
from runtime.state import chunk_inputs
from speculative_fixtures import assert_greedy_margin

KINDS = ["dense", "moe", "two_attention"]


def _ours(path):
    config, weights = load_checkpoint(path)
    return TorchRunner(NemotronH(config, weights, torch.float32))


def _theirs(path):
    return NemotronHForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _prompt(vocab, n, seed):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _their_logits(theirs, prompt, out):
    """transformers' logits [1, N, V] at the positions that chose ``out`` (teacher forced, one forward)."""
    with torch.no_grad():
        return theirs(torch.tensor([prompt + out[:-1]])).logits[:, len(prompt) - 1:].float()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_transformers(kind, checkpoints):
    ours, theirs = _ours(checkpoints[kind]), _theirs(checkpoints[kind])
    prompt = _prompt(ours.config.vocab_size, 21, 0)  # spans 3 SSD chunks of 8, the last one partial
    with torch.no_grad():
        ref = theirs(torch.tensor([prompt])).logits[0]
    ids, positions, lengths = chunk_inputs([prompt], [0])
    state = ours.new_state(1, 32)
    logits, _, _ = ours.forward(ids, positions, lengths, torch.arange(21, dtype=torch.int32)[None], state)
    assert _rel(logits[0], ref) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_decode_matches_transformers_cache(kind, checkpoints):
    ours, theirs = _ours(checkpoints[kind]), _theirs(checkpoints[kind])
    prompt = _prompt(ours.config.vocab_size, 9, 1)
    follow = _prompt(ours.config.vocab_size, 32, 2)
    with torch.no_grad():
        out = theirs(torch.tensor([prompt]), use_cache=True)
        cache, ref = out.cache, []
        for t in follow:
            out = theirs(torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = out.cache
            ref.append(out.logits[0, -1])
    ids, positions, lengths = chunk_inputs([prompt], [0])
    state = ours.new_state(1, 64)
    _, state, _ = ours.forward(ids, positions, lengths, (lengths - 1)[:, None], state)
    zero = torch.zeros(1, 1, dtype=torch.int32)
    for step, t in enumerate(follow):
        pos = torch.tensor([[len(prompt) + step]], dtype=torch.int32)
        logits, state, _ = ours.forward(torch.tensor([[t]], dtype=torch.int32), pos, torch.ones(1, dtype=torch.int32),
                                     zero, state)
        assert _rel(logits[0, 0], ref[step]) < 1e-4, f"decode step {step}"
    # the recurrent state itself, after 9 + 32 tokens
    for i, kind_i in enumerate(ours.config.layer_types):
        if kind_i == "mamba":
            theirs_ssm = cache.get_recurrent_state(i, state_idx=0)
            assert _rel(state[f"layers.{i}.ssm_state"], theirs_ssm) < 1e-4
            theirs_conv = cache.get_conv_state(i, state_idx=0)[:, :, 1:]  # keeps K inputs; we keep K-1
            assert _rel(state[f"layers.{i}.conv_state"], theirs_conv.transpose(1, 2)) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_matches_transformers_generate(kind, checkpoints):
    ours, theirs = _ours(checkpoints[kind]), _theirs(checkpoints[kind])
    prompt = _prompt(ours.config.vocab_size, 7, 3)
    theirs.generation_config.eos_token_id = None  # 32 tokens whatever comes (ours: no end_ids given)
    with torch.no_grad():
        ref = theirs.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert len(ref) == 32
    # two implementations, many orders: no near-tie may decide a token (transformers' logits in the spread)
    assert_greedy_margin(ours, [prompt], [ref], others=[_their_logits(theirs, prompt, ref)])
    result = generate(ours, [prompt], 32)
    assert result.output_ids[0] == ref
    assert len(set(ref)) > 3  # the model is not degenerate: the comparison means something


def test_batch_of_different_lengths_equals_one_by_one(checkpoints):
    """Right padding must not leak: each sequence of a ragged batch decodes as it would alone."""
    ours = _ours(checkpoints["two_attention"])
    prompts = [_prompt(ours.config.vocab_size, n, 10 + n) for n in (1, 6, 13)]
    batched = generate(ours, prompts, 12).output_ids
    assert_greedy_margin(ours, prompts, batched)
    alone = [generate(ours, [p], 12).output_ids[0] for p in prompts]
    assert batched == alone


def test_chunked_prefill_equals_whole_prefill(checkpoints):
    ours = _ours(checkpoints["moe"])
    prompt = _prompt(ours.config.vocab_size, 19, 4)
    whole = generate(ours, [prompt], 10, prefill_chunk=512).output_ids
    assert_greedy_margin(ours, [prompt], whole)
    chunked = generate(ours, [prompt], 10, prefill_chunk=5).output_ids
    assert whole == chunked


def test_moe_with_latent_projection_and_group_routing_matches_transformers(tmp_path_factory):
    """moe_latent_size (experts run in a smaller latent space) and n_group/topk_group routing."""
    from tiny_models import tiny_checkpoint
    path = tiny_checkpoint("moe", tmp_path_factory, moe_latent_size=16, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=False)
    ours, theirs = _ours(path), _theirs(path)
    assert ours.config.moe_latent_size == 16 and ours.config.n_group == 4
    prompt = _prompt(ours.config.vocab_size, 12, 5)
    with torch.no_grad():
        ref = theirs(torch.tensor([prompt])).logits[0]
    ids, positions, lengths = chunk_inputs([prompt], [0])
    logits, _, _ = ours.forward(ids, positions, lengths, torch.arange(12, dtype=torch.int32)[None],
                             ours.new_state(1, 16))
    assert _rel(logits[0], ref) < 1e-4
    theirs.generation_config.eos_token_id = None
    with torch.no_grad():
        want = theirs.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    want = want[0, 12:].tolist()
    assert_greedy_margin(ours, [prompt], [want], others=[_their_logits(theirs, prompt, want)])
    assert generate(ours, [prompt], 16).output_ids[0] == want
