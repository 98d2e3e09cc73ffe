"""nemospec speculative: the speculative loop behind Triton, decoupled, with in-flight batching.

One ``runtime.scheduler.Scheduler`` per model instance runs in a background thread over the engine
directory (``runtime.loading.open_engine_dir``). ``execute`` validates each request, submits it and
returns at once; requests that arrive while others run join the next step's batch. The scheduler's
callback only queues its tokens; a dispatcher thread turns them into responses (one per step with
``stream: true``, one at the end otherwise), polls ``request.is_cancelled()`` (cancelled or
disconnected clients free their sequence through ``scheduler.cancel``) and publishes the scheduler's
metrics as Prometheus metrics (``nemospec_*`` on the metrics port). A client's cancellation of the
ensemble request reaches this model through postprocessing (see ``serving.cancel.notify_cancel``): each
response carries ``request_key``, and a listener thread frees the sequences reported cancelled.

Request parameter ``speculative`` (``{"speculative": false}``) runs that request target-only on the
same engines.
"""
import json
import os
import locale
import queue
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_POLL_SECONDS = 0.1        # is_cancelled() per request, at most this often from the token path
SWEEP_SECONDS = 0.1              # every live request (queued ones too), and the metric gauges
METRICS_SECONDS = 0.1            # Prometheus updates, at most this often: each is a round trip to the
                                 # server (~0.1 ms), too dear per step for a small model
REQUEST_BUCKETS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0]
LATENCY_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]


def _param(config, key, default=None):
    return config.get("parameters", {}).get(key, {}).get("string_value", default)


class _Live:
    """One request in flight."""

    def __init__(self, request, sender, options, prompt):
        self.request, self.sender, self.options, self.prompt = request, sender, options, prompt
        self.stream = options.stream
        self.arrival_ns = time.time_ns()
        self.scheduled_ns = self.first_token_ns = self.last_token_ns = self.sent_ns = 0
        self.itl_ns = self.itl_tokens = 0   # inter-token time and tokens not yet observed
        self.logprobs = []
        self.alternatives = []     # each emitted token's most probable tokens (top_log_probs)
        self.speculation = {"steps": 0, "draft_tokens": 0, "accepted_draft_tokens": 0, "histogram": []}
        self.id = None
        self.emitted = []          # ids already sent (streaming) or collected (not streaming)
        self.done = False
        self.checked = time.monotonic()


class TritonPythonModel:
    def _calibrate_schedule(self, max_batch):
        """--draft_len_schedule auto: each batch size up to the max measured here, its steps compiled
        first (before the warm-up stops compiling); returns the draft lengths the schedule adds."""
        policy = self.loaded.draft_policy
        if not self.loaded.speculative or not policy.auto_schedule:
            return ()
        from runtime.compiled.runner import warm_up
        from runtime.draft_len import (calibrate_schedule, calibration_prompts, describe_schedule,
                                       schedule_batch_sizes, scheduled_lengths)
        k_max, seq = int(self.loaded.max_draft_len), self.loaded.max_seq_len
        choice = calibrate_schedule(
            self.loaded, calibration_prompts(self.loaded.tokenizer_path, self.loaded.config.vocab_size), k_max,
            schedule_batch_sizes(max_batch or self.loaded.max_batch_size), max_seq_len=seq,
            warm=lambda k, batch: warm_up(self.loaded, batch, k, max_seq_len=seq))
        policy.schedule = choice["schedule"]
        pb_utils.Logger.log_info(f"nemospec speculative: {describe_schedule(choice)}")
        return scheduled_lengths(choice["schedule"], k_max)

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = config["name"]
        root = _param(config, "nemospec_root")
        if root and root not in sys.path:
            sys.path.insert(0, root)
        from runtime.loading import open_engine_dir
        from runtime.scheduler import Request, Scheduler, SchedulerError
        from runtime.draft_policy import policy_from
        from serving.cancel import cancel_listener, request_key
        from serving.protocol import (FAULT, STOPPING, coalesce_events, fault, prompt_context, stream_window,
                                      text_history, unpack_word_ids)
        self.fault, self.FAULT, self.STOPPING = fault, FAULT, STOPPING
        from serving.repository import decode_policy
        from serving import request_fields
        from serving.tensors import REQUEST_INPUTS
        self.fields, self.BadInput = request_fields, request_fields.BadInput
        self.input_names = ("input_ids", "max_tokens") + tuple(t.name for t in REQUEST_INPUTS)
        self.Request, self.SchedulerError = Request, SchedulerError
        self.stream_window, self.unpack, self.request_key = stream_window, unpack_word_ids, request_key
        self.text_history, self.prompt_context = text_history, prompt_context
        self.coalesce = coalesce_events
        self.pid = os.getpid()
        import torch
        torch.set_num_threads(int(_param(config, "torch_threads", "1") or 1))
        self.loaded = open_engine_dir(_param(config, "engine_dir"), _param(config, "backend", "auto"))
        from tokenizers import Tokenizer
        from serving.protocol import byte_fallback_ids   # a stream's window begins where a run of them does
        path = self.loaded.tokenizer_path
        tokenizer = Tokenizer.from_file(str(path)) if path else None
        self.byte_ids = byte_fallback_ids(tokenizer) if tokenizer else {}
        if self.loaded.speculative:  # the engine directory's adaptive draft length, flags on top
            self.loaded.draft_policy = policy_from(self.loaded.max_draft_len, self.loaded.build_options,
                                                   decode_policy(_param(config, "draft_policy", "")))
        max_batch = int(_param(config, "max_batch_size", "0") or 0) or None
        from runtime.compiled.runner import SERVING_WARM_UPS, warm_up_for_serving   # no compile inside a request
        try:   # the stub's embedded Python reads files as ASCII; inductor's templates are UTF-8
            locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
        except locale.Error:
            pass
        also = self._calibrate_schedule(max_batch)
        reopen = {"engine_dir": _param(config, "engine_dir"), "backend": _param(config, "backend", "auto"),
                  "threads": torch.get_num_threads(), "policy": vars(decode_policy(_param(config, "draft_policy", "")))}
        warm = warm_up_for_serving(self.loaded, int(self.loaded.max_draft_len or 0) if self.loaded.speculative else 0,
                                   log=pb_utils.Logger.log_info, also=also, reopen=reopen,
                                   **SERVING_WARM_UPS[_param(config, "warm_up", "all")])
        if warm:
            pb_utils.Logger.log_info(f"nemospec speculative: compiled steps warmed up in {warm:.1f} s")
        self.scheduler = Scheduler(self.loaded, max_batch_size=max_batch, max_queue=int(_param(config, "max_queue", "64")),
                                   logprobs_mode=_param(config, "logprobs_mode", "processed_logprobs"))
        self.vocab = self.loaded.config.vocab_size
        self.max_draft_len = int(self.loaded.max_draft_len or 0)
        eos = self.loaded.config.eos_token_id
        # and the tokenizer's eos_token (chat templates end a turn with it), as vLLM and the TensorRT-LLM
        # backend stop on it; offline generate keeps the model's own (transformers' generate)
        from builder.tokenizer_file import tokenizer_eos_id
        turn_end = tokenizer_eos_id(_param(config, "engine_dir"), tokenizer) if tokenizer else None
        self.default_end = frozenset([*(eos if isinstance(eos, (tuple, list)) else [] if eos is None else [eos]),
                                      *([] if turn_end is None else [turn_end])])
        self.events = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.live = {}
        self._stopping = False
        self._draining = False   # the server is about to stop: new requests are refused (``_drain``)
        self._init_metrics()
        self.scheduler.start()
        self.dispatcher = threading.Thread(target=self._dispatch, name="nemospec-dispatch", daemon=True)
        self.dispatcher.start()
        cancel_dir = _param(config, "cancel_dir")
        self._close_listener = cancel_listener(cancel_dir, lambda rid: self.events.put(("cancel", rid, True, {})),
                                               lambda: self.events.put(("shutdown", None, True, {})),
                                               lambda rid: self.events.put(("stopped", rid, True, {})),
                                               self._drain) if cancel_dir else None
        pb_utils.Logger.log_info(f"nemospec speculative: {self.loaded.backend} backend, mode "
                                 f"{(self.loaded.speculative or {}).get('mode', 'none')}, "
                                 f"max_batch_size {self.scheduler.max_batch_size}, max_queue {self.scheduler.max_queue}")

    # --- metrics -----------------------------------------------------------------------------------
    def _init_metrics(self):
        MF = pb_utils.MetricFamily
        labels = {"model": self.name}
        k = max(1, int(self.loaded.max_draft_len or 0))
        self._families = []

        def metric(name, description, kind, buckets=None):
            family = MF(name=name, description=description, kind=kind)
            self._families.append(family)
            return family.Metric(labels=labels, buckets=buckets) if buckets else family.Metric(labels=labels)

        self.m = {
            "steps": metric("nemospec_steps_total", "Scheduler steps (one speculative round or decode step per group)", MF.COUNTER),
            "verify_rows": metric("nemospec_verify_rows_total", "Sequence rows verified by the target (one per sequence per speculative step)", MF.COUNTER),
            "accepted_tokens": metric("nemospec_accepted_tokens_total", "Tokens gained over all verify rows (accepted drafts + bonus)", MF.COUNTER),
            "generated_tokens": metric("nemospec_generated_tokens_total", "Tokens generated (a step's tokens past a cancel or stop string included)", MF.COUNTER),
            "draft_seconds": metric("nemospec_draft_seconds_total", "Seconds spent proposing drafts", MF.COUNTER),
            "verify_seconds": metric("nemospec_verify_seconds_total", "Seconds the speculative group spent in target forwards (verify, or decode in a step with K = 0)", MF.COUNTER),
            "active_sequences": metric("nemospec_active_sequences", "Sequences in the running batch", MF.GAUGE),
            "queued": metric("nemospec_queued_requests", "Requests waiting for a batch slot", MF.GAUGE),
            "max_batch_seen": metric("nemospec_max_batch_seen", "Largest batch a step has run", MF.GAUGE),
            "mean_accepted": metric("nemospec_mean_accepted_tokens", "Tokens gained per verify row since start", MF.GAUGE),
            "failed_steps": metric("nemospec_failed_steps_in_a_row", "Scheduler steps that raised since the last that did not", MF.GAUGE),
            "eager_steps": metric("nemospec_eager_steps_total", "Compiled-path steps run eagerly (exact, several times slower) because the warm-up did not compile their shape; the log names each shape once", MF.COUNTER),
            # histograms: one observation per metrics update (<= every METRICS_SECONDS), the mean per
            # step over the steps since the previous one
            "accepted_per_step": metric("nemospec_accepted_tokens_per_step", "Tokens gained per verify row (mean per step over each update interval)",
                                        MF.HISTOGRAM, [1.0 + i / 2 for i in range(2 * k + 1)]),
            "draft_latency": metric("nemospec_draft_latency_seconds", "Draft seconds per step of the speculative group (mean over each update interval)", MF.HISTOGRAM, LATENCY_BUCKETS),
            "verify_latency": metric("nemospec_verify_latency_seconds", "Target forward seconds (verify, or decode in a step with K = 0) per step of the speculative group (mean over each update interval)", MF.HISTOGRAM, LATENCY_BUCKETS),
        }
        # vLLM's / TensorRT-LLM's speculative-decoding families, under nemospec_
        self.m.update({
            "spec_drafts": metric("nemospec_spec_decode_num_drafts_total", "Draft proposals verified (one per sequence per speculative step)", MF.COUNTER),
            "spec_draft_tokens": metric("nemospec_spec_decode_num_draft_tokens_total", "Draft tokens proposed and verified", MF.COUNTER),
            "spec_accepted_tokens": metric("nemospec_spec_decode_num_accepted_tokens_total", "Draft tokens the target accepted", MF.COUNTER),
            "received": metric("nemospec_requests_received_total", "Requests handed to the model (each ends in one nemospec_requests_total outcome)", MF.COUNTER),
            "prompt_tokens": metric("nemospec_prompt_tokens_total", "Prompt tokens of the requests accepted (queued or running; a request cancelled while queued counts too)", MF.COUNTER),
            "e2e_latency": metric("nemospec_e2e_request_latency_seconds", "Arrival to last response, per completed request", MF.HISTOGRAM, REQUEST_BUCKETS),
            "ttft": metric("nemospec_time_to_first_token_seconds", "Arrival to the first generated token", MF.HISTOGRAM, REQUEST_BUCKETS),
            "itl": metric("nemospec_inter_token_latency_seconds", "Time between responses per token they carry", MF.HISTOGRAM, LATENCY_BUCKETS),
        })
        family = MF(name="nemospec_spec_decode_num_accepted_tokens_per_pos_total",
                    description="Rows that accepted the draft token at each position (0-based)", kind=MF.COUNTER)
        self._families.append(family)
        self.per_position = [family.Metric(labels={"model": self.name, "position": str(j)}) for j in range(k)]
        self._last_at = [0] * k
        family = MF(name="nemospec_requests_total", description="Requests by outcome", kind=MF.COUNTER)
        self._families.append(family)
        self.outcomes = {o: family.Metric(labels={"model": self.name, "outcome": o})
                         for o in ("completed", "cancelled", "rejected", "failed")}
        policy = self.loaded.draft_policy if self.loaded.speculative else None
        self.schedule_metrics = []
        if policy is not None and policy.schedule:   # K by batch size, as given or as --draft_len_schedule auto measured it
            family = MF(name="nemospec_draft_len_schedule", kind=MF.GAUGE,
                        description="Draft tokens per step for batches up to max_batch_size (--draft_len_schedule)")
            self._families.append(family)
            for batch, draft_len in policy.schedule.items():
                gauge = family.Metric(labels={"model": self.name, "max_batch_size": str(batch)})
                gauge.set(draft_len)
                self.schedule_metrics.append(gauge)
        self._last = {"steps": 0, "verify_rows": 0, "accepted_tokens": 0, "generated_tokens": 0,
                      "draft_seconds": 0.0, "verify_seconds": 0.0, "draft_tokens": 0, "accepted_draft_tokens": 0}
        self._gauges = {}

    def _refresh_metrics(self):
        s = dict(self.scheduler.metrics)
        last = self._last
        steps = s.get("steps", 0) - last["steps"]
        spec_steps = s.get("spec_steps", 0) - self._spec_steps_before   # the group the latencies are of
        self._spec_steps_before = s.get("spec_steps", 0)
        for key, name in (("steps", "steps"), ("verify_rows", "verify_rows"), ("accepted_tokens", "accepted_tokens"),
                          ("generated_tokens", "generated_tokens"), ("draft_seconds", "draft_seconds"),
                          ("verify_seconds", "verify_seconds"), ("draft_tokens", "spec_draft_tokens"),
                          ("accepted_draft_tokens", "spec_accepted_tokens")):
            delta = s.get(key, 0) - last[key]
            if delta > 0:
                self.m[name].increment(delta)
                if key == "verify_rows":
                    self.m["spec_drafts"].increment(delta)
            last[key] = s.get(key, 0)
        steps_module = sys.modules.get("runtime.compiled.steps")   # imported only on the compiled path
        eager = sum(steps_module.EAGER_AFTER_WARM_UP.values()) if steps_module else 0
        if eager > self._eager_before:
            self.m["eager_steps"].increment(eager - self._eager_before)
            self._eager_before = eager
        for j, count in (s.get("accepted_at") or {}).items():
            if j < len(self.per_position) and count > self._last_at[j]:
                self.per_position[j].increment(count - self._last_at[j])
                self._last_at[j] = count
        if steps > 0:
            rows = s.get("verify_rows", 0) - self._rows_before
            accepted = s.get("accepted_tokens", 0) - self._accepted_before
            draft = s.get("draft_seconds", 0.0) - self._draft_before
            verify = s.get("verify_seconds", 0.0) - self._verify_before
            if rows > 0:
                self.m["accepted_per_step"].observe(accepted / rows)
            if draft > 0 and spec_steps > 0:
                self.m["draft_latency"].observe(draft / spec_steps)
            if verify > 0 and spec_steps > 0:
                self.m["verify_latency"].observe(verify / spec_steps)
        self._rows_before, self._accepted_before = s.get("verify_rows", 0), s.get("accepted_tokens", 0)
        self._draft_before, self._verify_before = s.get("draft_seconds", 0.0), s.get("verify_seconds", 0.0)
        gauges = {"active_sequences": s.get("active_sequences", 0), "queued": s.get("queued", 0),
                  "max_batch_seen": s.get("max_batch_seen", 0), "failed_steps": s.get("failed_steps_in_a_row", 0),
                  "mean_accepted": (s["accepted_tokens"] / s["verify_rows"]) if s.get("verify_rows") else 0.0}
        for key, value in gauges.items():
            if self._gauges.get(key) != value:
                self.m[key].set(value)
                self._gauges[key] = value

    _rows_before = _accepted_before = _spec_steps_before = _eager_before = 0
    _draft_before = _verify_before = 0.0

    # --- requests ----------------------------------------------------------------------------------
    def _words(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        try:
            return () if tensor is None else self.unpack(tensor.as_numpy(), name, self.vocab)
        except ValueError as e:
            raise self.BadInput(str(e)) from None

    def _parse(self, request):
        inputs = {}
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        try:
            parameters = json.loads(request.parameters() or "{}")
        except ValueError:
            parameters = {}
        fields, options = self.fields.parse(inputs, parameters, vocab=self.vocab, default_end=self.default_end,
                                            max_draft_len=self.max_draft_len)
        r = self.Request(**fields, stop_words=self._words(request, "stop_words_ids"),
                         bad_words=self._words(request, "bad_words_ids"))
        return r, options

    def _refuse(self, sender, message, outcome="rejected"):
        try:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)
        except Exception:
            pass
        self.outcomes[outcome].increment(1)

    def execute(self, requests):
        for request in requests:
            self.m["received"].increment(1)   # before any response: the supervisor's stall check counts on it
            sender = request.get_response_sender()
            if self._draining:
                self._refuse(sender, f"speculative: {self.STOPPING}")
                continue
            try:
                r, options = self._parse(request)
                entry = _Live(request, sender, options, r.prompt_ids)
                with self.lock:
                    entry.id = self.scheduler.submit(r, lambda new, finished, info, e=entry: self._on_tokens(e, new, finished, info))
                    self.live[entry.id] = entry
                self.m["prompt_tokens"].increment(len(r.prompt_ids))
            except (self.BadInput, self.SchedulerError) as e:
                self._refuse(sender, str(e))
            except Exception as e:  # never take the server down for one request
                self._refuse(sender, self.fault("speculative", e), "failed")
        return None

    # --- the dispatcher: tokens -> responses ---------------------------------------------------------
    def _on_tokens(self, entry, new, finished, info):
        """The scheduler's callback (its thread): count the step, hand the tokens to the dispatcher."""
        now = time.time_ns()
        if not entry.scheduled_ns:
            entry.scheduled_ns = info.get("admitted_ns") or now
        if new:
            entry.first_token_ns = entry.first_token_ns or now
            entry.last_token_ns = now
        self.events.put((entry, list(new), bool(finished), dict(info)))

    def _tensors(self, entry, new, context, prefix_len, finished, mean, logprobs, reason, alternatives=()):
        """A response's output tensors. Every response carries what the text needs (request_key,
        output_ids, context_ids, prefix_len, finished); the rest as the TensorRT-LLM backend sends it:
        log probs with ``return_log_probs``, token counts with ``return_num_input_tokens`` /
        ``return_num_output_tokens``, the perf metrics (KV-cache counts, timestamps, acceptance)
        with ``return_perf_metrics`` and in the final response. Each tensor is a
        shared-memory block the server copies per response: 22 of them cost ~1.2 ms a response on a
        2-core CPU, more than a speculative step."""
        options = entry.options
        one = lambda name, value, dtype: pb_utils.Tensor(name, np.array([[value]], dtype=dtype))  # noqa: E731
        out = [pb_utils.Tensor("request_key", np.array([[self.request_key(self.pid, entry.id)]], dtype=np.int64)),
               pb_utils.Tensor("output_ids", np.asarray(new, dtype=np.int32).reshape(1, -1)),
               pb_utils.Tensor("context_ids", np.asarray(context, dtype=np.int32).reshape(1, -1)),
               one("prefix_len", prefix_len, np.int32),
               one("finished", finished, np.bool_)]
        if options.return_log_probs:   # never a 0 that reads as probability 1
            out += [pb_utils.Tensor("cum_log_probs", np.array([[sum(entry.logprobs)]], dtype=np.float32)),
                    pb_utils.Tensor("output_log_probs", np.asarray(logprobs, dtype=np.float32).reshape(1, 1, -1))]
        if options.top_log_probs:   # [1, tokens, N], id -1 where a token had fewer alternatives
            ids = np.full((1, len(alternatives), options.top_log_probs), -1, dtype=np.int32)
            # probability 0 as the lowest float32, not -inf: Triton's HTTP JSON writes -inf as the bare
            # token -Infinity, which strict JSON parsers (JavaScript's, Go's) refuse with the whole answer
            values = np.full(ids.shape, np.finfo(np.float32).min, dtype=np.float32)
            for t, top in enumerate(alternatives):
                for j, (token, value) in enumerate(top or ()):
                    ids[0, t, j], values[0, t, j] = token, max(value, float(np.finfo(np.float32).min))
            out += [pb_utils.Tensor("output_top_ids", ids), pb_utils.Tensor("output_top_log_probs", values)]
        if options.return_num_input_tokens:
            out.append(one("num_input_tokens", len(entry.prompt), np.int32))
        if options.return_num_output_tokens:
            out.append(one("num_output_tokens", len(new), np.int32))
        spec = entry.speculation
        drafts, accepted = int(spec["draft_tokens"]), int(spec["accepted_draft_tokens"])
        if not (finished or options.return_perf_metrics):
            if options.return_acceptance:    # three small tensors, not the perf metrics' fifteen
                out += [one("total_accepted_draft_tokens", accepted, np.int32), one("total_draft_tokens", drafts, np.int32),
                        pb_utils.Tensor("acceptance_histogram",
                                        np.asarray(spec["histogram"] or [0], dtype=np.int32).reshape(1, -1))]
            return out
        out += [one("batch_index", 0, np.int32),
                one("sequence_index", 0, np.int32),
                # one fixed KV slot per sequence, allocated at admission, never shared
                one("kv_cache_alloc_new_blocks", 1, np.int32),
                one("kv_cache_reused_blocks", 0, np.int32),
                one("kv_cache_alloc_total_blocks", 1, np.int32),
                one("arrival_time_ns", entry.arrival_ns, np.int64),
                one("first_scheduled_time_ns", entry.scheduled_ns, np.int64),
                one("first_token_time_ns", entry.first_token_ns, np.int64),
                one("last_token_time_ns", entry.last_token_ns, np.int64),
                one("acceptance_rate", accepted / drafts if drafts else 0.0, np.float32),
                one("total_accepted_draft_tokens", accepted, np.int32),
                one("total_draft_tokens", drafts, np.int32),
                pb_utils.Tensor("acceptance_histogram", np.asarray(spec["histogram"] or [0], dtype=np.int32).reshape(1, -1)),
                one("mean_accepted_tokens", mean, np.float32),
                pb_utils.Tensor("finish_reason", np.array([[reason.encode()]], dtype=np.object_))]
        return out

    def _finish(self, entry, outcome):
        entry.done = True
        with self.lock:
            self.live.pop(entry.id, None)
        self.outcomes[outcome].increment(1)

    def _cancel(self, entry, outcome: str = "cancelled"):
        with self.lock:
            request_id = entry.id
        if request_id is not None:
            self.scheduler.cancel(request_id)
        try:
            entry.sender.send(flags=FINAL)
        except Exception:
            pass
        self._finish(entry, outcome)

    def _cancelled(self, entry, now):
        entry.checked = now
        try:
            return entry.request.is_cancelled()
        except Exception:
            return True

    def _deliver(self, entry, new, finished, info):
        if entry == "shutdown":     # the server stops: what is in flight ends with an error now
            return self._abort_all()
        if isinstance(entry, str):  # ("cancel" | "stopped", request id) from the cancel listener
            stopped = entry == "stopped"
            with self.lock:
                entry = self.live.get(new)
            if entry is not None and not entry.done:
                if stopped:   # ended by its client as complete (a stop string): a finished request's latency
                    self._observe_latency(entry, 0, True)
                self._cancel(entry, "completed" if stopped else "cancelled")
            return
        if entry.done:
            return
        if entry.id is None:
            with self.lock:  # execute assigns the id under the lock
                pass
        if "error" in info:
            self._refuse(entry.sender, f"speculative{self.FAULT}generation failed: {info['error']}", "failed")
            entry.done = True
            with self.lock:
                self.live.pop(entry.id, None)
            return
        now = time.monotonic()
        if now - entry.checked >= CANCEL_POLL_SECONDS and self._cancelled(entry, now):
            self._cancel(entry)
            return
        if "speculation" in info:
            entry.speculation = info["speculation"]
        # tokens per verify step, from the same counts every response carries (a request that never
        # drafts has no verify step: 0, in its streamed responses as in its final one)
        spec = entry.speculation
        mean = (spec["accepted_draft_tokens"] + spec["steps"]) / spec["steps"] if spec.get("steps") else 0.0
        logprobs = info.get("logprobs") or []
        entry.logprobs.extend(logprobs)
        alternatives = info.get("top_logprobs") or []
        entry.alternatives.extend(alternatives)
        reason = info.get("finish_reason", "") if finished else ""
        # an end id ends the ids but not the text, as the TensorRT-LLM backend (which returns neither)
        # and vLLM (ids with it, text without) answer: a non-special end id's text would leak otherwise
        untext = 1 if finished and info.get("ended_at_end_id") else 0
        self._observe_latency(entry, len(new), finished)
        try:
            if entry.stream:
                if new or finished:
                    context, prefix_len = self.stream_window(self.text_history(entry.prompt, entry.emitted), new,
                                                             self.byte_ids)
                    context = context[:len(context) - untext]
                    response = pb_utils.InferenceResponse(self._tensors(entry, new, context, prefix_len, finished, mean,
                                                                        logprobs, reason, alternatives))
                    entry.emitted.extend(new)
                    entry.sender.send(response, flags=FINAL if finished else 0)
            else:
                entry.emitted.extend(new)
                if finished:
                    if entry.options.exclude_input_in_output:   # its text as it reads after the prompt
                        ids, before = entry.emitted, self.prompt_context(entry.prompt, self.byte_ids)
                    else:
                        ids, before = entry.prompt + entry.emitted, []
                    text_ids = before + ids
                    response = pb_utils.InferenceResponse(
                        self._tensors(entry, ids, text_ids[:len(text_ids) - untext], len(before), True, mean,
                                      entry.logprobs, reason, entry.alternatives))
                    entry.sender.send(response, flags=FINAL)
        except Exception:  # the client went away: free its sequence
            self._cancel(entry)
            return
        if finished:
            self._finish(entry, "completed")

    def _observe_latency(self, entry, tokens, finished):
        """TTFT and end-to-end latency once per request; inter-token latency summed per request and
        observed by ``_flush_itl`` (each observation is a round trip to the server, ~0.26 ms measured:
        per response it cost a fifth of the dispatcher's time)."""
        now = time.time_ns()
        if tokens:
            if entry.sent_ns:
                entry.itl_ns += now - entry.sent_ns
                entry.itl_tokens += tokens
            else:
                self.m["ttft"].observe((now - entry.arrival_ns) / 1e9)
            entry.sent_ns = now
        if finished:
            self._flush_itl(entry)
            self.m["e2e_latency"].observe((now - entry.arrival_ns) / 1e9)

    def _flush_itl(self, entry):
        """One inter-token latency observation: the request's mean time per token over the responses
        since its last one (at most every METRICS_SECONDS, and at its end)."""
        if entry.itl_tokens:
            self.m["itl"].observe(entry.itl_ns / 1e9 / entry.itl_tokens)
            entry.itl_ns = entry.itl_tokens = 0

    def _live_entries(self):
        with self.lock:
            return list(self.live.values())

    def _sweep(self):
        now = time.monotonic()
        for entry in self._live_entries():
            if not entry.done and now - entry.checked >= SWEEP_SECONDS and self._cancelled(entry, now):
                self._cancel(entry)

    def _dispatch(self):
        last_sweep = last_metrics = time.monotonic()
        while not self._stopping:
            try:
                item = self.events.get(timeout=SWEEP_SECONDS)
            except queue.Empty:
                item = None
            try:
                items = []
                while item is not None:
                    items.append(item)
                    try:
                        item = self.events.get_nowait()
                    except queue.Empty:
                        item = None
                for item in self.coalesce(items) if len(items) > 1 else items:
                    self._deliver(*item)
                now = time.monotonic()
                if now - last_metrics >= METRICS_SECONDS:  # no round trips when nothing changed
                    last_metrics = now
                    self._refresh_metrics()
                    for entry in self._live_entries():
                        self._flush_itl(entry)
                if now - last_sweep >= SWEEP_SECONDS:
                    last_sweep = now
                    self._sweep()
            except Exception as e:  # keep dispatching whatever one response did
                pb_utils.Logger.log_error(f"nemospec dispatcher: {type(e).__name__}: {e}")

    def _drain(self):
        """The server is about to stop (``serving.launch.ServerHandle.stop``, before it signals Triton):
        new requests are refused with the stop's error, those held are served (the server reads when
        none is left from the request counters: ``serving.health.StallWatch.in_flight``)."""
        self._draining = True

    def finalize(self):
        self._stopping = True
        if self._close_listener is not None:
            self._close_listener()
        self.scheduler.stop()
        self.dispatcher.join(timeout=5)
        self._abort_all()

    def _abort_all(self):
        with self.lock:
            entries = list(self.live.values())
            self.live.clear()
        for entry in entries:
            if entry.id is not None:
                self.scheduler.cancel(entry.id)
            entry.done = True
            self._refuse(entry.sender, f"speculative: {self.STOPPING}", "failed")
