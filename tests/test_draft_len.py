"""``--num_draft_tokens auto`` (runtime.draft_len): the K that measured costs and acceptance pick."""
import json

import pytest

from nemospec import cli
from runtime.draft_len import Costs, acceptance_rates, choose, draft_len_arg, expected_tokens


def test_rates_reproduce_the_histogram_they_came_from():
    """a_j from a histogram of tokens per verify; the chain of rates gives back the histogram's mean
    (the oracle: the mean counted directly) and its tail at every K."""
    hist = {"1": 10, "2": 20, "3": 30, "4": 40}   # K = 3: 0..3 proposals accepted
    rates = acceptance_rates(hist, 3)
    assert rates == pytest.approx([0.9, 70 / 90, 40 / 70])
    mean = sum(int(n) * c for n, c in hist.items()) / sum(hist.values())
    assert expected_tokens(rates, 3) == pytest.approx(mean)
    # a K=2 chain accepts a prefix of the same proposals: tokens min(n, 3)
    assert expected_tokens(rates, 2) == pytest.approx((10 * 1 + 20 * 2 + 70 * 3) / 100)
    assert acceptance_rates({"1": 5}, 2) == [0.0, 0.0] and expected_tokens([0.0, 0.0], 2) == 1.0


def _costs(verify_ms, block=False, buckets=()):
    return Costs(k_max=4, decode_ms=10.0, target_only_step_ms=11.0, verify_ms=verify_ms, draft_ms=2.0,
                 fixed_ms=1.0, block=block, buckets=buckets)


def test_memory_bound_verify_drafts_the_whole_chain_and_compute_bound_drafts_less():
    rates = [0.8, 0.7, 0.6, 0.5]
    k, table = choose(_costs(verify_ms=11.0), rates)        # 5 rows at 1.1x a decode: memory-bound
    assert k == 4 and table[4] == max(table.values())
    brute = {kk: expected_tokens(rates, kk) * 11.0 / (2.0 * kk / 4 + 10.0 + (11.0 - 10.0) * kk / 4 + 1.0)
             for kk in range(1, 5)}
    assert table == pytest.approx(brute, abs=1e-3)
    k, table = choose(_costs(verify_ms=40.0), rates)        # 5 rows at 4x: compute-bound
    assert k == 1 and table[1] > table[4]


def test_block_drafts_pay_one_call_and_verify_buckets_pad_rows():
    rates = [0.9, 0.9, 0.9, 0.9]
    chain, block = _costs(30.0), _costs(30.0, block=True)
    assert chain.draft(1) == 0.5 and block.draft(1) == block.draft(4) == 2.0
    padded = _costs(30.0, buckets=(2, 3, 5))
    assert padded.rows(3) == 5 and padded.verify(3) == padded.verify(4) == 30.0   # 4 rows run as 5
    assert padded.verify(2) == pytest.approx(10.0 + 20.0 * 2 / 4)
    k, _ = choose(padded, rates)
    assert k != 3, "K=3 pays K=4's verify for fewer tokens"


def test_the_flag_takes_auto_or_an_integer():
    assert draft_len_arg("auto") == "auto" and draft_len_arg("3") == 3
    with pytest.raises(ValueError):
        draft_len_arg("three")


def test_generate_auto_picks_a_k_and_keeps_the_target_output(capsys):
    """On the embedded model (eager, CPU): the calibration's K is within 1..4, its prediction table is
    reported, and the output equals target-only greedy."""
    argv = ["generate", "--speculative_decoding_mode", "eagle3", "--backend", "torch", "--input_ids",
            "5,9,17,33,2,8", "--max_new_tokens", "24", "--json"]
    assert cli.main(argv + ["--num_draft_tokens", "auto"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out.strip().splitlines()[-1])
    assert "--num_draft_tokens auto: K=" in err
    choice = record["draft_len_auto"]
    assert 1 <= record["num_draft_tokens"] == choice["k"] <= 4
    assert set(choice["predicted"]) == {1, 2, 3, 4} or set(choice["predicted"]) == {"1", "2", "3", "4"}
    assert cli.main(["generate", "--backend", "torch", "--input_ids", "5,9,17,33,2,8", "--max_new_tokens", "24",
                     "--json", "--no_speculation"]) == 0
    plain = json.loads(capsys.readouterr()[0].strip().splitlines()[-1])
    assert record["output_ids"] == plain["output_ids"]


@pytest.mark.parametrize("extra, needle", [(["--no_speculation"], "target-only"), (["--num_draft_tokens", "x"], "")])
def test_auto_on_a_target_only_run_or_a_bad_value_exits_2(extra, needle, capsys):
    argv = ["generate", "--speculative_decoding_mode", "eagle3", "--backend", "torch", "--input_ids", "5,9",
            "--max_new_tokens", "4"]
    if "--num_draft_tokens" not in extra:
        extra = extra + ["--num_draft_tokens", "auto"]
    try:
        code = cli.main(argv + extra)
    except SystemExit as e:   # argparse's own exit for a value its type refuses
        code = e.code
    _, err = capsys.readouterr()
    assert code == 2 and "--num_draft_tokens" in err and needle in err


# --- --draft_len_schedule auto ---------------------------------------------------------------------------
def test_schedule_entry_turns_speculation_off_where_no_k_pays():
    """Per batch size: memory-bound rows keep the whole chain; where a verify costs its rows' share
    (b(K+1) rows compute-bound: 5 rows 5x a decode) no K beats target-only, so K = 0."""
    from runtime.draft_len import schedule_entry
    rates = [0.8, 0.7, 0.6, 0.5]
    assert schedule_entry(_costs(verify_ms=11.0), rates)[0] == 4
    compute_bound = Costs(k_max=4, decode_ms=10.0, target_only_step_ms=10.5, verify_ms=50.0, draft_ms=2.0,
                          fixed_ms=0.5, block=False)
    k, table = schedule_entry(compute_bound, rates)
    assert k == 0 and max(table.values()) <= 1.0
    assert choose(compute_bound, rates)[0] >= 1          # choose alone always drafts something


def test_schedule_flag_auto_and_batch_sizes():
    from types import SimpleNamespace

    from runtime.draft_len import calibration_prompts, schedule_batch_sizes
    from runtime.draft_policy import policy_from
    policy = policy_from(4, {}, SimpleNamespace(draft_len_schedule="auto"))
    assert policy.auto_schedule and policy.schedule == {} and policy.k_for_batch(16) == 4
    assert not policy_from(4, {"draft_len_schedule": "1:4,16:0"}).auto_schedule
    assert schedule_batch_sizes(16) == [1, 2, 4, 8, 16] and schedule_batch_sizes(6) == [1, 2, 4, 6]
    assert schedule_batch_sizes(1) == [1]
    from builder.embedded import target_dir
    prompts = calibration_prompts(target_dir() / "tokenizer.json", 1024)
    assert len(prompts) == 5 and all(prompts) and all(0 <= t < 4096 for p in prompts for t in p)
    assert calibration_prompts(None, 100) == [[(7 * i + 3 * j + 1) % 100 for j in range(6)] for i in range(5)]


def test_generate_schedule_auto_measures_its_batch_and_keeps_the_target_output(capsys):
    """Two prompts on the embedded model (eager, CPU): the calibrated schedule has the one batch size
    of the run, its K within 0..4 and its predictions; the output equals target-only greedy."""
    ids = ["--input_ids", "5,9,17,33,2,8", "--input_ids", "12,4,99,7"]
    argv = ["generate", "--speculative_decoding_mode", "eagle3", "--backend", "torch", *ids,
            "--max_new_tokens", "20", "--json"]
    assert cli.main(argv + ["--draft_len_schedule", "auto"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out.strip().splitlines()[-1])
    assert "--draft_len_schedule auto: 2:" in err
    choice = record["draft_len_schedule_auto"]
    (batch, k), = choice["schedule"].items()
    assert int(batch) == 2 and 0 <= k <= 4 and len(choice["predicted"][batch]) == 4
    measured = choice["measured"][batch]                     # K_max's run, and the proposed K's when shorter
    assert set(measured) >= {"4"} or set(measured) >= {4}
    assert k == 0 or (str(k) in measured or k in measured)
    assert cli.main(["generate", "--backend", "torch", *ids, "--max_new_tokens", "20", "--json",
                     "--no_speculation"]) == 0
    plain = json.loads(capsys.readouterr()[0].strip().splitlines()[-1])
    assert record["output_ids"] == plain["output_ids"]
