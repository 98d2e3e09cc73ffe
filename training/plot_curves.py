"""Loss curves of the embedded model (README): ``python -m training.plot_curves [--out docs/training_curves.png]``.

Reads ``builder/embedded/TRAINING.json`` (written by ``training.train_embedded``'s package stage).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from builder import embedded


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/training_curves.png")
    args = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads((embedded.ROOT / "TRAINING.json").read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    curve = data["target"]["curve"]
    left.plot([c["step"] for c in curve], [c["train_loss"] for c in curve], label="train")
    left.plot([c["step"] for c in curve], [c["valid_loss"] for c in curve], label="validation (held-out files)")
    left.set_title(f"target: next-token cross entropy ({data['target']['seconds'] / 60:.0f} min)")
    left.set_xlabel("step")
    left.legend()
    for kind, d in data["drafts"].items():
        c = d["curve"]
        right.plot([x["step"] for x in c], [x["valid_first_token_accuracy"] for x in c], label=kind)
    right.set_title("drafts: first drafted token = target's greedy token (validation)")
    right.set_xlabel("step")
    right.set_ylim(0, 1)
    right.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
