"""Speculative decoding speed per mode, measured side by side in one run (CPU, TorchRunner).

For each mode on one target/draft pair: greedy tokens/s with and without speculation, mean
accepted tokens per target forward, and the ratio; the outputs are checked identical first. The
peer is transformers: its plain ``generate`` on the same target, and its assisted generation with
the draft_target draft where transformers supports it (5.24 refuses stateful models such as
NemotronH; the script says so rather than guessing a number).

    python benchmarks/speculative.py [--new_tokens 64] [--runs 3] [--k 4]

The default pair is random (acceptance is low: nothing was trained); the embedded trained model
(a later issue) gives meaningful acceptance.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":   # timed on the allocator the commands use (runtime.allocator)
    from runtime.allocator import preload
    preload()
from builder.checkpoint import load_checkpoint  # noqa: E402
from builder.drafts import load_draft  # noqa: E402
from builder.models.mtp import MTPDraft  # noqa: E402
from builder.models.nemotron_h import NemotronH  # noqa: E402
from builder.random_checkpoint import write_layer_subset_draft, write_random_checkpoint  # noqa: E402
from runtime.drafts import EagerDraft  # noqa: E402
from runtime.generation import generate  # noqa: E402
from runtime.block_proposers import BlockDraftProposer, ParallelDraftProposer  # noqa: E402
from runtime.proposers import FeatureDraftProposer, ModelDraftProposer  # noqa: E402
from runtime.runner import TorchRunner  # noqa: E402
from runtime.speculative import speculative_generate  # noqa: E402


def _median_seconds(fn, runs):
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp())
    # hidden 32 / vocabulary 96: the shape of the speculators-made EAGLE fixtures in tests/
    target_dir = write_random_checkpoint(root / "target", "ME*EM-M*-ME-M", hidden_size=32, vocab_size=96,
                                         head_dim=8, mamba_num_heads=4, mtp_pattern="*E")
    draft_dir = write_layer_subset_draft(target_dir, root / "draft", [0, 1, 2, 3])
    config, weights = load_checkpoint(target_dir)
    dconfig, dweights = load_checkpoint(draft_dir)
    fixtures = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "speculators"
    fixture = {"eagle": "eagle_speculators", "eagle3": "eagle3_llama3", "dflash": "dflash_speculators",
               "dspark": "dspark_speculators", "peagle": "peagle_speculators"}
    drafts = {mode: load_draft(mode, config, weights, fixtures / name, torch.float32, log=lambda m: None)
              for mode, name in fixture.items()}
    drafts["dspark nvfp4"] = load_draft("dspark", config, weights, fixtures / fixture["dspark"], torch.float32,
                                        log=lambda m: None, quantization="nvfp4_w4a16")
    # each draft gets a target capturing exactly the layers it reads
    targets = {mode: TorchRunner(NemotronH(config, weights, **d.target_features)) for mode, d in drafts.items()}
    kinds = {"dflash": BlockDraftProposer, "dspark": BlockDraftProposer, "peagle": ParallelDraftProposer}
    target = TorchRunner(NemotronH(config, weights, final_hidden=True))
    proposers = {
        "draft_target": (target, lambda: ModelDraftProposer(TorchRunner(NemotronH(dconfig, dweights)))),
        "mtp": (target, lambda: FeatureDraftProposer(EagerDraft(MTPDraft(config, weights), config.vocab_size))),
    }
    for mode, d in drafts.items():
        make = kinds.get(mode.split()[0], FeatureDraftProposer)
        proposers[mode] = (targets[mode], lambda make=make, d=d: make(EagerDraft(d.module, config.vocab_size)))
    prompt = [[int(t) for t in torch.randint(3, config.vocab_size, (16,), generator=torch.Generator().manual_seed(0))]]
    reference = generate(target, prompt, args.new_tokens).output_ids
    base = _median_seconds(lambda: generate(target, prompt, args.new_tokens), args.runs)
    print(f"target only (nemospec TorchRunner): {args.new_tokens / base:8.1f} tokens/s")
    bases = {id(target): base}   # target-only on the runner each mode speculates with (its captures)
    for mode, (runner, make) in proposers.items():
        result = speculative_generate(runner, make(), prompt, args.new_tokens, args.k)
        assert result.output_ids == reference, f"{mode}: speculative output differs from target greedy"
        if id(runner) not in bases:
            bases[id(runner)] = _median_seconds(lambda: generate(runner, prompt, args.new_tokens), args.runs)
        spec = _median_seconds(lambda: speculative_generate(runner, make(), prompt, args.new_tokens, args.k), args.runs)
        acc = result.extra["acceptance"]["mean_accepted_tokens"]
        print(f"{mode:13s} K={args.k}: {args.new_tokens / spec:8.1f} tokens/s, mean accepted {acc:.2f}, "
              f"speedup over target only on the same runner {bases[id(runner)] / spec:.2f}x")
    from transformers import NemotronHForCausalLM
    theirs = NemotronHForCausalLM.from_pretrained(str(target_dir)).eval()
    theirs.generation_config.eos_token_id = None
    ids = torch.tensor(prompt)
    with torch.no_grad():
        hf = _median_seconds(lambda: theirs.generate(ids, max_new_tokens=args.new_tokens, do_sample=False,
                                                     pad_token_id=0), args.runs)
        print(f"transformers generate: {args.new_tokens / hf:8.1f} tokens/s; nemospec target only is {hf / base:.2f}x")
        assistant = NemotronHForCausalLM.from_pretrained(str(draft_dir)).eval()
        try:
            theirs.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, assistant_model=assistant)
        except ValueError as e:
            print(f"transformers assisted generation (draft_target pair): not available: {e}")


if __name__ == "__main__":
    main()
