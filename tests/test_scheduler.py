"""In-flight batching scheduler (what the Triton `speculative` model runs), tested in-process."""
import threading

import pytest

from builder.engine import BuildOptions, build
from runtime.generation import generate
from runtime.loading import open_engine_dir
from runtime.scheduler import Request, Scheduler, SchedulerError
from speculative_fixtures import assert_greedy_margin, layer_subset_draft, target_with_mtp


@pytest.fixture(scope="module")
def loaded(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("sched")
    target = target_with_mtp(checkpoints["moe"], root / "target")
    draft = layer_subset_draft(target, root / "draft")
    engine = root / "engine"
    build(target, engine, BuildOptions(max_batch_size=4, max_input_len=16, max_seq_len=64, max_draft_len=3,
                                       speculative_decoding_mode="draft_target"), log=lambda m: None, draft_dir=draft)
    return open_engine_dir(engine, backend="torch")


PROMPTS = [[5, 9, 17, 33], [7], [12, 13, 14], [40, 41, 42, 43, 44, 45], [3, 60], [8, 8, 8], [20, 30]]


class Collector:
    def __init__(self):
        self.tokens, self.finished, self.info = [], False, None
        self.calls = 0

    def __call__(self, new, finished, info):
        assert not self.finished, "no tokens after the end"
        self.calls += 1
        self.tokens += new
        self.finished, self.info = finished, info


def _drain(scheduler, limit=10_000):
    for _ in range(limit):
        if not scheduler.step():
            return
    raise AssertionError("scheduler did not finish")


def test_in_flight_batching_equals_sequential_results(loaded):
    want = generate(loaded.runner, PROMPTS, 20).output_ids
    assert_greedy_margin(loaded.runner, PROMPTS, want, 3)  # batched, joined, speculative: no near-tie may decide
    scheduler = Scheduler(loaded)
    outs = [Collector() for _ in PROMPTS]
    for p, c in zip(PROMPTS[:2], outs[:2]):
        scheduler.submit(Request(p, 20), c)
    for _ in range(3):  # the first two run alone for a few steps ...
        scheduler.step()
    for p, c in zip(PROMPTS[2:], outs[2:]):  # ... then the rest join the running batch
        scheduler.submit(Request(p, 20, speculative=len(p) % 2 == 0), c)
    _drain(scheduler)
    assert [c.tokens for c in outs] == want
    assert all(c.finished and c.calls > 1 for c in outs)  # streamed, not one answer at the end
    assert scheduler.metrics["max_batch_seen"] == 4  # max_batch_size 4: the rest waited in the queue
    assert max(scheduler.batch_sizes) == 4 and scheduler.metrics["active_sequences"] == 0
    assert scheduler.metrics["generated_tokens"] == 20 * len(PROMPTS)
    assert scheduler.metrics["verify_rows"] > 0 and scheduler.metrics["accepted_tokens"] >= scheduler.metrics["verify_rows"]
    assert "mean_accepted_tokens" in outs[0].info


def test_seeded_sampling_does_not_depend_on_the_batch(loaded):
    def sample(extra):
        scheduler = Scheduler(loaded)
        mine = Collector()
        scheduler.submit(Request([5, 9, 17], 16, temperature=1.2, top_p=0.9, seed=123), mine)
        for p in extra:
            scheduler.submit(Request(p, 16, temperature=0.7, seed=len(p)), Collector())
        _drain(scheduler)
        return mine.tokens
    alone = sample([])
    assert sample(PROMPTS[:3]) == alone
    assert len(alone) == 16


def test_every_bit_of_a_64_bit_seed_picks_the_stream(loaded):
    """random_seed is UINT64: S and S + 2^32 (and S + 2^63) drew one stream when torch's CPU generator
    kept the low 32 bits; a seed under 2^32 keeps the stream torch.manual_seed gives it."""
    import torch
    from runtime.sampling import seeded_generator

    def draws(seed):
        return torch.rand(8, generator=seeded_generator(seed)).tolist()
    assert draws(5) == torch.rand(8, generator=torch.Generator().manual_seed(5)).tolist()
    streams = {tuple(draws(s)) for s in (5, 5 + 2**32, 5 + 2**63, 2**64 - 1, 2**32 - 1, 2**33 + 5)}
    assert len(streams) == 6

    def sample(seed):
        scheduler = Scheduler(loaded)
        mine = Collector()
        scheduler.submit(Request([5, 9, 17], 16, temperature=1.5, seed=seed), mine)
        _drain(scheduler)
        return mine.tokens
    assert sample(5 + 2**32) == sample(5 + 2**32) != sample(5)


def test_a_seeded_request_with_its_own_draft_length_does_not_depend_on_the_batch(loaded):
    """A seeded request drafting fewer tokens than the rest of its batch (num_draft_tokens 1 beside
    requests at the engine's K): its draws past its own K are not made from its generator, so its
    output is the one it gives alone."""
    def sample(extra):
        scheduler = Scheduler(loaded)
        mine = Collector()
        scheduler.submit(Request([5, 9, 17], 16, temperature=1.2, top_p=0.9, seed=7, max_draft=1), mine)
        for p in extra:
            scheduler.submit(Request(p, 16, temperature=0.7, seed=len(p)), Collector())
        _drain(scheduler)
        return mine.tokens
    alone = sample([])
    assert sample(PROMPTS[:3]) == alone and len(alone) == 16


def test_cancel_frees_the_sequence(loaded):
    scheduler = Scheduler(loaded)
    doomed, other = Collector(), Collector()
    rid = scheduler.submit(Request([5, 9, 17, 33], 40), doomed)
    scheduler.submit(Request([7], 10), other)
    scheduler.step()
    scheduler.step()
    seen = len(doomed.tokens)
    scheduler.cancel(rid)
    _drain(scheduler)
    assert len(doomed.tokens) == seen and not doomed.finished
    assert other.finished and scheduler.metrics["active_sequences"] == 0
    assert scheduler.metrics["requests_cancelled"] == 1
    queued = scheduler.submit(Request([5], 5), Collector())
    scheduler.cancel(queued)  # cancelled before admission: never runs
    _drain(scheduler)
    assert scheduler.metrics["requests_cancelled"] == 2


@pytest.mark.parametrize("request_, field", [
    (Request([], 4), "text_input"),
    (Request([1, 2], 0), "max_tokens"),
    (Request([1, 2], 63), "max_tokens"),
    (Request(list(range(3, 20)), 4), "max_input_len"),
    (Request([1, 2], 4, temperature=-0.5), "temperature"),
    (Request([1, 2], 4, top_p=0.0), "top_p"),
    (Request([1, 1000], 4), "input_ids"),
])
def test_bad_requests_are_refused_naming_the_field(request_, field, loaded):
    scheduler = Scheduler(loaded)
    with pytest.raises(SchedulerError, match=field):
        scheduler.submit(request_, Collector())
    good = Collector()
    scheduler.submit(Request([5, 6], 4), good)
    _drain(scheduler)
    assert good.finished


def test_full_queue_is_refused_then_recovers(loaded):
    """A burst is taken up to the free batch slots plus --max_queue waiting (the queue is admitted
    between steps: a burst at an idle server was refused with slots free); a cancelled request
    waiting in the queue holds no place."""
    scheduler = Scheduler(loaded, max_batch_size=2, max_queue=2)
    ids = [scheduler.submit(Request([5], 4), Collector()) for _ in range(4)]     # 2 free slots + 2 waiting
    with pytest.raises(SchedulerError, match="busy: 2 requests queued beyond the batch"):
        scheduler.submit(Request([5], 4), Collector())
    scheduler.cancel(ids[-1])
    scheduler.submit(Request([5], 4), Collector())
    with pytest.raises(SchedulerError, match="busy"):
        scheduler.submit(Request([5], 4), Collector())
    _drain(scheduler)
    scheduler.submit(Request([5], 4), Collector())


def test_a_cancelled_sequence_still_in_the_batch_holds_no_place(loaded):
    """A client that cancels at its stop string and sends the next request at once, at batch 1 and
    --max_queue 0: the cancelled sequence leaves at the step's sweep, so the newcomer waits for that
    step instead of being refused as busy; a second newcomer is refused."""
    scheduler = Scheduler(loaded, max_batch_size=1, max_queue=0)
    first, second = Collector(), Collector()
    request_id = scheduler.submit(Request([5, 9, 17], 40), first)
    while not first.tokens:
        scheduler.step()
    with pytest.raises(SchedulerError, match="busy"):
        scheduler.submit(Request([7], 4), Collector())
    scheduler.cancel(request_id)
    scheduler.submit(Request([7], 4), second)
    with pytest.raises(SchedulerError, match="busy"):
        scheduler.submit(Request([7], 4), Collector())
    _drain(scheduler)
    assert second.finished and len(second.tokens) == 4 and not first.finished
    assert scheduler.metrics["requests_cancelled"] == 1


def test_requests_arriving_while_others_prefill_keep_the_queue_bound(loaded, monkeypatch):
    """Requests taken off the queue are neither queued nor active while they prefill: a burst that
    arrived then saw their slots free, and the queue went past --max_queue (67 of 64 under load)."""
    import threading
    scheduler = Scheduler(loaded, max_batch_size=2, max_queue=2)
    prefilling, go = threading.Event(), threading.Event()
    add = type(scheduler.spec or scheduler.plain).add

    def slow_add(group, seqs):
        prefilling.set()
        go.wait(30)
        return add(group, seqs)

    monkeypatch.setattr(type(scheduler.plain), "add", slow_add)
    if scheduler.spec is not None:
        monkeypatch.setattr(type(scheduler.spec), "add", slow_add)
    for _ in range(2):
        scheduler.submit(Request([5], 4), Collector())
    stepper = threading.Thread(target=scheduler.step)
    stepper.start()                                   # takes both into the batch and prefills them
    assert prefilling.wait(30)
    accepted = 0
    for _ in range(5):
        try:
            scheduler.submit(Request([5], 4), Collector())
            accepted += 1
        except SchedulerError as e:
            assert "busy: 2 requests queued beyond the batch (max_queue 2)" in str(e)
    go.set()
    stepper.join(30)
    assert accepted == 2                              # the batch is full: max_queue waiting, no more
    _drain(scheduler)


def test_stop_words_bad_words_and_end_ids(loaded):
    free = generate(loaded.runner, [[5, 9]], 20).output_ids[0]
    assert_greedy_margin(loaded.runner, [[5, 9]], [free], 3)
    scheduler = Scheduler(loaded)
    stop, banned, end, across = Collector(), Collector(), Collector(), Collector()
    scheduler.submit(Request([5, 9], 20, stop_words=(tuple(free[3:5]),)), stop)
    # a stop word that begins in the prompt ends at its first generated token (TensorRT-LLM's
    # criterion reads the whole sequence): the prompt's last id, then the first output
    scheduler.submit(Request([5, 9], 20, stop_words=((9, free[0]),)), across)
    scheduler.submit(Request([5, 9], 20, bad_words=((free[0],),)), banned)
    scheduler.submit(Request([5, 9], 20, end_ids=frozenset({free[6]})), end)
    _drain(scheduler)
    assert stop.tokens == free[:5]
    assert across.tokens == free[:1]
    assert banned.tokens[0] != free[0] and free[0] not in banned.tokens
    assert end.tokens == free[:free.index(free[6]) + 1]


def test_background_thread_serves_concurrent_submitters(loaded):
    want = generate(loaded.runner, PROMPTS, 12).output_ids
    assert_greedy_margin(loaded.runner, PROMPTS, want, 3)
    scheduler = Scheduler(loaded)
    scheduler.start()
    try:
        outs = [Collector() for _ in PROMPTS]
        done = [threading.Event() for _ in PROMPTS]

        def client(i):
            def cb(new, finished, info):
                outs[i](new, finished, info)
                if finished:
                    done[i].set()
            scheduler.submit(Request(PROMPTS[i], 12), cb)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for e in done:
            assert e.wait(timeout=120)
        assert [c.tokens for c in outs] == want
    finally:
        scheduler.stop()


@pytest.mark.parametrize("mode", ["mtp", "eagle", "eagle3", "dflash", "dspark", "peagle", "dspark_nvfp4"])
def test_every_draft_mode_runs_in_flight_batches(mode, checkpoints, tmp_path_factory):
    """The server's scheduler is mode-agnostic: every draft kind, joining a running batch, gives
    exactly the target's greedy output."""
    from runtime.loading import Loaded
    from speculative_fixtures import runners, target_with_mtp
    target_dir = target_with_mtp(checkpoints["moe"], tmp_path_factory.mktemp(mode) / "target")
    target, proposer = runners(target_dir)
    loaded_ = Loaded(target, target.config, None, 64, 16, "torch", {"mode": mode}, 3, 4, lambda: proposer(mode))
    want = generate(target, PROMPTS, 12).output_ids
    assert_greedy_margin(target, PROMPTS, want, 3)
    scheduler = Scheduler(loaded_)
    outs = [Collector() for _ in PROMPTS]
    for p, c in zip(PROMPTS[:3], outs[:3]):
        scheduler.submit(Request(p, 12), c)
    scheduler.step()
    for p, c in zip(PROMPTS[3:], outs[3:]):
        scheduler.submit(Request(p, 12), c)
    _drain(scheduler)
    assert [c.tokens for c in outs] == want
    assert scheduler.metrics["verify_rows"] > 0


def test_a_failed_admission_answers_the_newcomers_and_keeps_serving(loaded, monkeypatch):
    """A prefill that raises while admitting (a device out of memory, say) fails the requests being
    admitted as well as the running ones, each told once, and the next request is served: none is
    left without an answer for the supervisor to read as a stall."""
    want = generate(loaded.runner, PROMPTS[:1], 8).output_ids
    scheduler = Scheduler(loaded)
    running, newcomer, later = Collector(), Collector(), Collector()
    scheduler.submit(Request(PROMPTS[1], 20, speculative=False), running)
    scheduler.step()
    assert running.tokens and not running.finished
    group = scheduler.plain
    monkeypatch.setattr(group, "add", lambda seqs: (_ for _ in ()).throw(RuntimeError("out of memory")))
    scheduler.submit(Request(PROMPTS[2], 20, speculative=False), newcomer)
    scheduler.step()
    for c in (running, newcomer):
        assert c.finished and c.calls >= 1 and "out of memory" in c.info["error"], c.info
    assert scheduler.metrics["failed_steps_in_a_row"] == 1     # the supervisor restarts a model past 3
    monkeypatch.undo()
    scheduler.submit(Request(PROMPTS[0], 8), later)
    _drain(scheduler)
    assert later.finished and [later.tokens] == want
    assert scheduler.metrics["failed_steps_in_a_row"] == 0


def test_a_failed_admission_in_one_group_still_answers_the_other_groups_newcomers(loaded, monkeypatch):
    """One admission takes requests for both groups; when the first group's prefill raised, the other
    group's newcomers, already off the queue, were never added nor failed: they hung with no answer."""
    scheduler = Scheduler(loaded)
    plain, spec = Collector(), Collector()
    monkeypatch.setattr(scheduler.plain, "add", lambda seqs: (_ for _ in ()).throw(RuntimeError("out of memory")))
    scheduler.submit(Request(PROMPTS[2], 20, speculative=False), plain)
    scheduler.submit(Request(PROMPTS[1], 20), spec)
    scheduler.step()
    assert plain.finished and "out of memory" in plain.info["error"], plain.info
    assert spec.finished and spec.calls >= 1, "the speculative newcomer was never answered"


def test_a_penalty_scaled_past_fp32_fails_no_one(loaded):
    """temperature 1e38 with frequency_penalty 4: the scaled penalty overflowed to inf and inf * 0 put
    NaN on every unseen token, whose draw raised and failed every request in flight with it."""
    want = generate(loaded.runner, PROMPTS[:1], 8).output_ids
    scheduler = Scheduler(loaded)
    odd, other = Collector(), Collector()
    scheduler.submit(Request(PROMPTS[0], 8), other)
    scheduler.submit(Request(PROMPTS[1], 8, temperature=1e38, top_k=40, frequency_penalty=4.0), odd)
    _drain(scheduler)
    assert "error" not in odd.info and odd.finished and len(odd.tokens) == 8, odd.info
    assert other.finished and [other.tokens] == want


def test_bad_words_of_one_and_two_tokens_are_never_generated(loaded):
    """A request's bad words: a one-token word is banned outright, a two-token one's second token
    right after its first; speculative and target-only requests answer alike, and each ban changes
    the answer it applies to."""
    def run(words):
        outs = []
        for speculative in (True, False):
            scheduler, c = Scheduler(loaded), Collector()
            scheduler.submit(Request(PROMPTS[0], 20, bad_words=words, speculative=speculative), c)
            _drain(scheduler)
            outs.append(c.tokens)
        assert outs[0] == outs[1], words
        return outs[0]
    free = generate(loaded.runner, PROMPTS[:1], 20).output_ids[0]
    one = run(((free[1],),))
    assert one != free and free[1] not in one
    pair = (one[3], one[4])
    both = run(((free[1],), pair))
    history = PROMPTS[0] + both
    assert both != one and free[1] not in both
    assert not any(tuple(history[i:i + 2]) == pair for i in range(len(PROMPTS[0]) - 1, len(history) - 1))


class LogprobCollector(Collector):
    def __init__(self):
        super().__init__()
        self.logprobs, self.top = [], []

    def __call__(self, new, finished, info):
        super().__call__(new, finished, info)
        self.logprobs += info.get("logprobs", [])
        self.top += info.get("top_logprobs", [])


@pytest.mark.parametrize("speculative", [True, False])
def test_raw_logprobs_are_the_models_own_log_softmax(loaded, speculative):
    """--logprobs_mode raw_logprobs (vLLM's default): a sampled request under temperature, top-k and a
    presence penalty gets the target's own log-softmax of each token, teacher forced (within the
    spread of the logits between decode and verify passes), and its alternatives are that
    distribution's top 3; the default processed_logprobs gives the drawn-from distribution's."""
    import torch
    from speculative_fixtures import teacher_forced_logits
    from tolerances import lm_head_bound, logit_order_bound
    prompt = [5, 9, 17, 33]
    request = dict(temperature=0.6, top_k=3, presence_penalty=0.8, seed=7, logprobs=True, top_logprobs=3,
                   speculative=speculative)
    got = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        scheduler, c = Scheduler(loaded, logprobs_mode=mode), LogprobCollector()
        scheduler.submit(Request(prompt, 12, **request), c)
        _drain(scheduler)
        got[mode] = c
    raw, processed = got["raw_logprobs"], got["processed_logprobs"]
    assert raw.tokens == processed.tokens and len(raw.logprobs) == len(raw.tokens) == 12
    runner = loaded.runner
    decode = teacher_forced_logits(runner, [prompt], [raw.tokens])[0].double()
    spread = float((teacher_forced_logits(runner, [prompt], [raw.tokens], 4, verify=True)[0].double() - decode).abs().max())
    bound = 2 * float(logit_order_bound(lm_head_bound(runner.module.norm_f, runner.module.lm_head), spread).max())
    oracle = torch.log_softmax(decode, -1)
    want = oracle.gather(-1, torch.tensor(raw.tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(raw.logprobs, dtype=torch.float64), want, rtol=0, atol=bound), (raw.logprobs, want)
    for position, alternatives in enumerate(raw.top):
        ids, ranked = [t for t, _ in alternatives], oracle[position].topk(4)
        assert len(ids) == 3
        if ranked.values[2] - ranked.values[3] > 2 * bound:   # no near-tie at the cut
            assert set(ids) == set(ranked.indices[:3].tolist()), position
    # the drawn-from distribution: top-k 3 leaves every other token out, temperature sharpens it
    assert all(len(a) <= 3 for a in processed.top)
    assert max(abs(a - b) for a, b in zip(raw.logprobs, processed.logprobs)) > 10 * bound


def test_an_unknown_logprobs_mode_is_refused(loaded):
    with pytest.raises(SchedulerError, match="--logprobs_mode: expected one of processed_logprobs, raw_logprobs"):
        Scheduler(loaded, logprobs_mode="raw")


def test_a_sampled_request_with_its_own_k_0_beside_a_speculating_one_is_served(loaded):
    """A sampled row that proposed nothing (its own num_draft_tokens 0, or under the acceptance floor)
    went through rejection sampling with no drafts: a TypeError or IndexError that failed every request
    in the batch. It draws its token as a decode does; both requests finish, the greedy one as alone."""
    want = generate(loaded.runner, PROMPTS[:1], 12).output_ids
    for first in (Request(PROMPTS[0], 12), Request(PROMPTS[0], 12, temperature=0.8, seed=1)):
        scheduler, a, b = Scheduler(loaded), Collector(), Collector()
        scheduler.submit(first, a)
        scheduler.submit(Request(PROMPTS[1], 12, temperature=1.0, seed=3, max_draft=0), b)
        _drain(scheduler)
        for c in (a, b):
            assert c.finished and "error" not in c.info and len(c.tokens) == 12, c.info
        if not first.temperature:
            assert [a.tokens] == want


@pytest.mark.parametrize("mode", ["dflash", "peagle"])
def test_a_newcomer_beside_a_request_near_the_caches_end_is_served(mode):
    """A block or parallel draft writes every row's pending context padded to the widest: a newcomer's
    8-token prompt beside a request 5 slots from max_seq_len wrote past the draft's cache, an
    IndexError that failed both. A call now writes what the nearest row has room for."""
    import dataclasses

    from builder import embedded
    from runtime.loading import open_checkpoint
    loaded = dataclasses.replace(open_checkpoint(embedded.target_dir(), mode=mode, draft_dir=embedded.draft_dir(mode),
                                                 backend="torch"), max_seq_len=24, max_input_len=8)
    old, new = [5, 9, 17], [100, 200, 300, 400, 500, 600, 700, 800]
    scheduler, a, b = Scheduler(loaded), Collector(), Collector()
    scheduler.submit(Request(old, 21), a)
    while len(a.tokens) < 16:
        scheduler.step()
    scheduler.submit(Request(new, 16), b)
    _drain(scheduler)
    assert "error" not in a.info and "error" not in b.info, (a.info, b.info)
    assert [a.tokens, b.tokens] == [generate(loaded.runner, [p], n).output_ids[0] for p, n in ((old, 21), (new, 16))]


def test_a_parallel_drafts_first_proposal_does_not_depend_on_a_long_prompt_beside_it():
    """P-EAGLE beside a prompt longer than its chunk: a row whose rows were all written in an early
    call proposed its first token from a padded row's logits (264 alone, 65 in the batch)."""
    from builder import embedded
    from runtime.loading import open_checkpoint
    from runtime.speculative import speculative_generate
    loaded = open_checkpoint(embedded.target_dir(), mode="peagle", draft_dir=embedded.draft_dir("peagle"), backend="torch")
    short, long_ = [5, 9, 17], (list(range(100, 1100)) * 2)[:600]
    first = []
    for prompts in ([short], [short, long_]):
        trace = []
        speculative_generate(loaded.runner, loaded.proposer(), prompts, 8, 4, trace=trace.append)
        first.append(next(t["proposed"] for t in trace if t["sequence"] == 0))
    assert first[0] == first[1]


def test_greedy_rows_verifying_different_numbers_of_drafts_take_the_fused_verify(loaded, monkeypatch):
    """Greedy requests with their own num_draft_tokens (1, 2, the engine's 3) in one batch: each row
    verifies its own drafts in the one-call greedy verify (a row's other rows are padding past its
    length), not the separate verify, accept and rollback (which on the compiled path is a graph the
    server's warm-up never compiles); outputs equal target-only greedy."""
    runner = loaded.runner
    unfused, fused = [], []
    forward, verify_greedy = runner.forward, runner.verify_greedy

    def counting_forward(*args, verify=False, **kwargs):
        unfused.append(verify)
        return forward(*args, verify=verify, **kwargs)

    def counting_verify(input_ids, positions, lengths, logit_index, state):
        fused.append(sorted(set(lengths.tolist())))
        return verify_greedy(input_ids, positions, lengths, logit_index, state)
    monkeypatch.setattr(runner, "forward", counting_forward)
    monkeypatch.setattr(runner, "verify_greedy", counting_verify)
    scheduler = Scheduler(loaded)
    prompts, own_k = PROMPTS[:3], (1, 2, 3)
    collectors = [Collector() for _ in prompts]
    for p, k, c in zip(prompts, own_k, collectors):
        scheduler.submit(Request(p, 12, max_draft=k), c)
    _drain(scheduler)
    monkeypatch.undo()
    assert [c.tokens for c in collectors] == [generate(loaded.runner, [p], 12).output_ids[0] for p in prompts]
    assert not any(unfused), "a greedy step verified through the separate forward"
    assert any(len(lengths) > 1 for lengths in fused), fused   # rows of different lengths in one call


def test_a_sequence_under_the_acceptance_floor_does_not_make_the_others_draft_for_it(loaded, monkeypatch):
    """A step drafts the most any speculating sequence asks for: beside a request of its own K 1, a
    request at the engine's K 3 that fell under the acceptance floor (it drafts nothing) once made
    every step draft 3, two of them verified by no one. Outputs equal target-only greedy."""
    scheduler = Scheduler(loaded)
    short, floored = Collector(), Collector()
    scheduler.submit(Request(PROMPTS[0], 12, max_draft=1), short)
    scheduler.submit(Request(PROMPTS[2], 12), floored)
    scheduler.step()                                   # admitted and prefilled
    group = scheduler.spec
    assert len(group.seqs) == 2
    group.seqs[1].acceptance.speculating = False       # as the floor leaves it, for good
    asked = []
    propose = group.proposer.propose

    def recording(k, *args, **kwargs):
        asked.append(k)
        return propose(k, *args, **kwargs)
    monkeypatch.setattr(group.proposer, "propose", recording)
    _drain(scheduler)
    assert asked and set(asked) == {1}, asked
    assert [short.tokens, floored.tokens] == [generate(loaded.runner, [p], 12).output_ids[0] for p in (PROMPTS[0], PROMPTS[2])]
