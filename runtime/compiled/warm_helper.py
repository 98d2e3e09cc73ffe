"""One warm-up helper process (``runtime.compiled.warm_helpers``): opens the engine directory as the
server did and runs the warm-up units it was given, in their order, compiling into the shared step
store what no other process has claimed yet.

    python -m runtime.compiled.warm_helper SPEC_JSON
"""
import json
import sys


def main(argv=None) -> int:
    spec = json.loads((argv or sys.argv)[1])
    import os
    if spec.get("parent") and os.getppid() != spec["parent"]:   # it died before PR_SET_PDEATHSIG was set
        return 0
    import torch
    from runtime.compiled.runner import serving_unit, serving_policy
    from runtime.draft_policy import policy_from
    from runtime.loading import open_engine_dir
    from types import SimpleNamespace
    torch.set_num_threads(int(spec["threads"]))
    loaded = open_engine_dir(spec["engine_dir"], spec["backend"])
    if loaded.speculative:
        loaded.draft_policy = policy_from(loaded.max_draft_len, loaded.build_options, SimpleNamespace(**spec["policy"]))
    policy = serving_policy(loaded)
    for unit in spec["units"]:
        serving_unit(loaded, unit, policy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
