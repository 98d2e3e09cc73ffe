"""``--max_tree_nodes auto`` (runtime.tree.sizing): the tree size, or the chain, the measured costs pick."""
import json

import pytest

from nemospec import cli
from runtime.tree.sizing import candidate_sizes


def test_candidates_span_the_standard_sizes_up_to_the_cap():
    assert candidate_sizes(32, 4) == [4, 8, 16, 32]
    assert candidate_sizes(12, 8) == [8, 12]          # the cap itself, and no size under top-k
    assert candidate_sizes(16, 4) == [4, 8, 16]


def test_generate_auto_sizes_the_tree_and_keeps_the_target_output(capsys):
    """On the embedded model (eager, CPU): every candidate (the chain, trees of 4..32 nodes under the
    default cap of 32) is calibrated, the one kept has the highest predicted speedup, the run uses it, and the
    output equals target-only greedy whichever was kept."""
    argv = ["generate", "--speculative_decoding_mode", "eagle3", "--backend", "torch", "--input_ids",
            "5,9,17,33,2,8", "--max_new_tokens", "24", "--json"]
    assert cli.main(argv + ["--tree", "--max_tree_nodes", "auto", "--max_draft_len", "4"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out.strip().splitlines()[-1])
    assert "--max_tree_nodes auto: " in err
    choice = record["tree_auto"]
    assert set(choice["predicted"]) == {"chain", "4", "8", "16", "32"}
    assert all(t >= 1.0 for t in choice["tokens_per_step"].values())
    kept = "chain" if choice["max_tree_nodes"] is None else str(choice["max_tree_nodes"])
    assert choice["predicted"][kept] == max(choice["predicted"].values())
    if choice["max_tree_nodes"] is None:
        assert "tree" not in record["acceptance"]
    else:
        assert record["acceptance"]["tree"]["max_nodes"] == choice["max_tree_nodes"]
    assert cli.main(["generate", "--backend", "torch", "--input_ids", "5,9,17,33,2,8", "--max_new_tokens", "24",
                     "--json", "--no_speculation"]) == 0
    plain = json.loads(capsys.readouterr()[0].strip().splitlines()[-1])
    assert record["output_ids"] == plain["output_ids"]


def test_a_bad_size_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--speculative_decoding_mode", "eagle3", "--backend", "torch", "--input_ids", "5,9",
                  "--max_new_tokens", "4", "--tree", "--max_tree_nodes", "many"])
    assert e.value.code == 2 and "--max_tree_nodes" in capsys.readouterr()[1]
