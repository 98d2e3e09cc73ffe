"""The OpenAI port's ``/metrics``: the server's own metrics text, led by the families that mean what
vLLM's do under vLLM's names, so that a dashboard, an autoscaler or a benchmark client made for vLLM
(aiperf scrapes ``<its --url>/metrics`` and reads ``vllm:spec_decode_*``) reads a nemospec server
unchanged. Each family keeps its values; the labels become vLLM's (``model_name``, ``engine``).

Only families whose meaning is vLLM's are renamed. Left out: the inter-token latency (ours observes a
request's mean per token over an interval, vLLM's every token gap: the same sum, other counts) and the
outcome counter (vLLM splits finished requests by stop and length, ours by completed, cancelled,
rejected and failed)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

#: our family (as the text parser names it: a counter without ``_total``) -> vLLM's
VLLM_NAMES = {
    "nemospec_active_sequences": "vllm:num_requests_running",
    "nemospec_queued_requests": "vllm:num_requests_waiting",
    "nemospec_prompt_tokens": "vllm:prompt_tokens",
    "nemospec_generated_tokens": "vllm:generation_tokens",
    "nemospec_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "nemospec_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "nemospec_spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "nemospec_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "nemospec_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "nemospec_spec_decode_num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
KEPT_LABELS = ("position", "le")   # the per-position counter's and a histogram bucket's own
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4   # the text format Triton writes and generate_latest renders


class _Renamed:
    """A prometheus_client collector of the families given (``generate_latest`` renders them)."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return iter(self.families)


def vllm_families(text: str, model_name: str) -> list[Metric]:
    """The families of Triton's metrics ``text`` that ``VLLM_NAMES`` names, renamed and relabelled."""
    out = []
    for family in text_string_to_metric_families(text):
        name = VLLM_NAMES.get(family.name)
        if name is None:
            continue
        renamed = Metric(name, family.documentation, family.type)
        for sample in family.samples:
            labels = {"model_name": model_name, "engine": "0",
                      **{k: v for k, v in sample.labels.items() if k in KEPT_LABELS}}
            renamed.add_sample(name + sample.name[len(family.name):], labels, sample.value)
        out.append(renamed)
    return out


def metrics_text(triton_text: str, model_name: str) -> str:
    """vLLM's families first, then Triton's whole text as it came (nemospec's and Triton's own)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Renamed(vllm_families(triton_text, model_name)))
    return generate_latest(registry).decode() + triton_text
