"""Target + draft pairs for the speculative tests, made by our own generators (no downloads)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from builder.drafts import load_draft
from builder.checkpoint import load_checkpoint
from builder.models.mtp import MTPDraft
from builder.models.nemotron_h import NemotronH
from builder.random_checkpoint import add_mtp_layers, write_layer_subset_draft
from runtime.drafts import EagerDraft
from runtime.block_proposers import BlockDraftProposer, ParallelDraftProposer
from runtime.proposers import FeatureDraftProposer, ModelDraftProposer
from runtime.runner import TorchRunner


def target_with_mtp(source, directory):
    """A copy of a transformers-written tiny target with NemotronH MTP layers appended."""
    shutil.copytree(source, directory)
    return add_mtp_layers(directory, "*E", seed=7)


FIXTURES = Path(__file__).parent / "fixtures" / "speculators"
# speculators-made drafts for the tiny "moe" target (hidden 32, vocabulary 96, 6 layers)
FEATURE_DRAFTS = {"eagle3": FIXTURES / "eagle3_llama3", "eagle": FIXTURES / "eagle_speculators",
                  "dflash": FIXTURES / "dflash_speculators", "dspark": FIXTURES / "dspark_speculators",
                  "peagle": FIXTURES / "peagle_speculators"}
PROPOSERS = {"dflash": BlockDraftProposer, "dspark": BlockDraftProposer, "peagle": ParallelDraftProposer}


def runners(target_dir, draft_dir=None):
    """(target runner with every feature, proposer factory by mode)."""
    config, weights = load_checkpoint(target_dir)
    drafts = {}
    if config.hidden_size == 32:
        for mode, path in FEATURE_DRAFTS.items():
            for quantization in ((None, "nvfp4_w4a16") if mode in PROPOSERS else (None,)):
                drafts[mode if quantization is None else f"{mode}_nvfp4"] = load_draft(
                    mode, config, weights, path, torch.float32, log=lambda m: None, quantization=quantization)
    # one target serves every draft: it captures the union of the layers they read
    capture = sorted({i for d in drafts.values() for i in d.target_features.get("capture_layers", ())})
    target = TorchRunner(NemotronH(config, weights, torch.float32, final_hidden=True, capture_layers=capture))

    def features_for(draft, feats):
        ids = draft.target_features.get("capture_layers")
        if not ids or list(ids) == capture:
            return feats
        width = config.hidden_size
        cols = [c for i in ids for c in range(capture.index(i) * width, (capture.index(i) + 1) * width)]
        return {**feats, "aux_hidden": [f[..., cols] for f in feats["aux_hidden"]] if isinstance(feats["aux_hidden"], list)
                else feats["aux_hidden"][..., cols]}

    def proposer(mode):
        if mode in drafts:
            d = drafts[mode]
            kind = mode.split("_")[0]
            inner = PROPOSERS.get(kind, FeatureDraftProposer)(EagerDraft(d.module, config.vocab_size))
            return _Narrowed(inner, lambda feats: features_for(d, feats))
        if mode == "draft_target":
            dcfg, dweights = load_checkpoint(draft_dir)
            return ModelDraftProposer(TorchRunner(NemotronH(dcfg, dweights, torch.float32)))
        if mode == "mtp":
            return FeatureDraftProposer(EagerDraft(MTPDraft(config, weights, torch.float32), config.vocab_size))
        raise ValueError(mode)

    return target, proposer


class _Narrowed:
    """A proposer whose draft reads a subset of the target's captured layers (tests share one target)."""

    def __init__(self, inner, narrow):
        self.inner, self.narrow, self.features = inner, narrow, inner.features

    def start(self, prompts, first_tokens, features, capacity):
        return self.inner.start(prompts, first_tokens, self.narrow(features), capacity)

    def accept(self, accepted, next_tokens, drafts, verify_features):
        return self.inner.accept(accepted, next_tokens, drafts, self.narrow(verify_features))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def layer_subset_draft(target_dir, directory, noise=0.05):
    """Every layer of the target with small noise: agrees often, not always (exercises rollback)."""
    config, _ = load_checkpoint(target_dir)
    return write_layer_subset_draft(target_dir, directory, list(range(config.num_layers)), noise=noise, seed=3)


def teacher_forced_logits(runner, prompts, outputs, chunk=1, verify=False):
    """[B, N, V] logits at every generated position of ``outputs`` (N tokens each), after one ragged
    prefill of the prompts, feeding the generated tokens back ``chunk`` at a time: chunk 1 repeats
    generate()'s decode steps exactly, chunk K+1 with ``verify`` is a speculative verify pass (all
    its rows accepted, the state rolled forward by the runner), and chunk None is one chunk of the
    whole sequence (the prefill path)."""
    from runtime.state import chunk_inputs
    n, batch = len(outputs[0]), len(prompts)
    assert all(len(o) == n for o in outputs), "teacher forcing needs outputs of one length"
    state = runner.new_state(batch, max(len(p) for p in prompts) + n)
    if chunk is None:  # everything in one forward, every row's logits
        seqs = [p + o[:-1] for p, o in zip(prompts, outputs)]
        ids, positions, lengths = chunk_inputs(seqs, [0] * batch)
        rows = torch.stack([torch.arange(len(p) - 1, len(p) - 1 + n) for p in prompts]).int()
        return runner.forward(ids, positions, lengths, rows, state)[0]
    ids, positions, lengths = chunk_inputs(prompts, [0] * batch)
    logits, state, _ = runner.forward(ids, positions, lengths, (lengths - 1)[:, None].int(), state)
    rows, done = [logits], 0
    while done < n - 1:
        step = min(chunk, n - 1 - done)
        ids, positions, lengths = chunk_inputs([o[done:done + step] for o in outputs], [len(p) + done for p in prompts])
        index = torch.arange(step, dtype=torch.int32).repeat(batch, 1)
        logits, new_state, _ = runner.forward(ids, positions, lengths, index, state, verify)
        state = runner.rollback(state, new_state, lengths - 1) if verify else new_state
        rows.append(logits)
        done += step
    return torch.cat(rows, 1)


def assert_greedy_margin(runner, prompts, outputs, draft_len=4, what="greedy reference", others=()):
    """The target's greedy trajectory has no near-tie that another computation order could flip.

    Speculative, batched, chunked and interpreted runs must equal target-only greedy token for
    token; they compute the same logits in other orders, so each step's top-1 must beat its
    runner-up by more than the logits can move between orders (tolerances.logit_order_bound: the
    LM head's own rounding bound plus SPREAD_FACTOR x the spread measured here between decode steps,
    verify chunks of draft_len + 1, one whole-sequence chunk and ``others``, [B, N, V] logits of the
    same positions computed elsewhere, e.g. by transformers). ``runner`` is an eager TorchRunner over
    NemotronH; ``outputs`` are the greedy tokens. Cheap: 1 + N + N / (draft_len + 1) forwards of the
    batch. Returns the smallest gap / bound ratio (> 1)."""
    from tolerances import assert_no_near_tie, lm_head_bound, logit_order_bound
    decode = teacher_forced_logits(runner, prompts, outputs)
    others = [teacher_forced_logits(runner, prompts, outputs, draft_len + 1, verify=True),
              teacher_forced_logits(runner, prompts, outputs, None), *others]
    spread = max(float((o.to(decode) - decode).abs().max()) for o in others)
    module = runner.module
    bound = logit_order_bound(lm_head_bound(module.norm_f, module.lm_head, runner.dtype), spread)
    return assert_no_near_tie(decode, torch.tensor(outputs), bound, what)


def assert_greedy_up_to_ties(runner, prompts, outputs, what="speculative output"):
    """Every token of ``outputs`` is the target's argmax after its own prefix, up to a tie within the
    dtype's rounding bound (tolerances.lm_head_bound in the runner's dtype): where a half-precision
    target cannot promise one greedy answer, either answer passes, and any other token fails.

    For targets whose greedy trajectories cannot keep a margin over the rounding of their dtype
    (bf16 logits are multiples of 2^-5 near 5: top-2 gaps of one bf16 step are common), where
    assert_greedy_margin cannot hold. Returns the number of steps decided by such a tie."""
    from tolerances import lm_head_bound
    logits = teacher_forced_logits(runner, prompts, outputs).double()
    module = runner.module
    bound = lm_head_bound(module.norm_f, module.lm_head, runner.dtype)
    tokens = torch.tensor(outputs)
    chosen, best = logits.gather(-1, tokens[..., None])[..., 0], logits.max(-1)
    short = best.values - chosen - bound[tokens] - bound[best.indices]
    if not (short <= 0).all():
        b, t = (int(v) for v in torch.unravel_index(short.argmax(), short.shape))
        raise AssertionError(f"{what}: sequence {b} step {t} emitted {int(tokens[b, t])} (logit {chosen[b, t].item():.4f}) "
                             f"where the target's argmax {int(best.indices[b, t])} has {best.values[b, t].item():.4f}, "
                             f"more than the rounding bound apart")
    return int((tokens != best.indices).sum())


def chi_square_p(counts, expected_probs):
    """Upper-tail p-value of Pearson's chi-square (bins with expectation < 5 merged)."""
    n = counts.sum()
    expected = expected_probs * n
    order = torch.argsort(expected, descending=True)
    counts, expected = counts[order].double(), expected[order].double()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), stat / 2)), dof
