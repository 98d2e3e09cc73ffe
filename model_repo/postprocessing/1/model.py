"""nemospec postprocessing: token ids -> text_output with the engine directory's tokenizer.

Each response of the decoupled ``speculative`` model arrives here on its own, so detokenization is
stateless: ``CONTEXT_IDS`` holds up to ``serving.protocol.CONTEXT_TOKENS`` tokens already streamed
(``PREFIX_LEN`` of them) followed by the new ones, and ``serving.protocol.stream_text`` returns what the
new tokens add, holding back an incomplete UTF-8 character until the response that completes it.
Every other output (``output_ids``, log probs, perf metrics, acceptance; ``serving.tensors.PASS_OUTPUTS``)
passes through from ``PASS_<name>`` to ``OUT_<name>``: all ensemble outputs come from this step.

Cancellation: Triton hands a client's cancellation of the ensemble request to the steps it schedules
next, i.e. to this model, not to the running ``speculative`` request. A cancelled request here
reports its ``REQUEST_KEY`` to the speculative instance (``serving.cancel.notify_cancel``), which then
frees the sequence.
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


CHECK_SECONDS = 0.05


def _param(config, key, default=None):
    return config.get("parameters", {}).get(key, {}).get("string_value", default)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        root = _param(config, "nemospec_root")
        if root and root not in sys.path:
            sys.path.insert(0, root)
        from tokenizers import Tokenizer

        from serving.cancel import notify_cancel
        from serving.protocol import fault, stream_text
        self._stream_text, self._notify_cancel, self._fault = stream_text, notify_cancel, fault
        self.cancel_dir = _param(config, "cancel_dir")
        self._checked = {}
        engine_dir = Path(_param(config, "engine_dir"))
        meta = json.loads((engine_dir / "config.json").read_text())
        self.tokenizer = Tokenizer.from_file(str(engine_dir / meta["tokenizer"]))
        self.passed = [(t["name"], "OUT_" + t["name"][5:], pb_utils.triton_string_to_numpy(t["data_type"]))
                       for t in config["input"] if t["name"].startswith("PASS_")]

    def _report_cancelled(self, request):
        """is_cancelled() costs a round trip to the server: asked at most every CHECK_SECONDS per
        request (and not for a final response, the request is over then)."""
        key = pb_utils.get_input_tensor_by_name(request, "REQUEST_KEY")
        if key is None or not self.cancel_dir:
            return False
        key = int(key.as_numpy().reshape(-1)[0])
        if bool(pb_utils.get_input_tensor_by_name(request, "FINISHED").as_numpy().reshape(-1)[0]):
            self._checked.pop(key, None)
            return False
        now = time.monotonic()
        if now - self._checked.get(key, 0.0) < CHECK_SECONDS:
            return False
        self._checked[key] = now
        if len(self._checked) > 4096:  # requests that never sent a final response (cancelled)
            self._checked = {k: t for k, t in self._checked.items() if now - t < 60}
        if request.is_cancelled():
            self._notify_cancel(self.cancel_dir, key)
            return True
        return False

    def _one(self, request):
        get = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()  # noqa: E731
        context = get("CONTEXT_IDS").reshape(-1).tolist()
        prefix_len = int(get("PREFIX_LEN").reshape(-1)[0])
        finished = bool(get("FINISHED").reshape(-1)[0])
        text = self._stream_text(self.tokenizer, context, prefix_len, finished)
        # shape [batch * beams] = [1], as the TensorRT-LLM backend returns it: its clients read text_output[0]
        out = [pb_utils.Tensor("OUTPUT", np.array([text.encode("utf-8")], dtype=np.object_))]
        for name, out_name, dtype in self.passed:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                out.append(pb_utils.Tensor(out_name, tensor.as_numpy().astype(dtype, copy=False)))
        return pb_utils.InferenceResponse(out)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                # a cancelled request still gets its normal response (Triton drops it): answering it
                # with an error left the ensemble request in flight forever in Triton 2.51
                self._report_cancelled(request)
                responses.append(self._one(request))
            except Exception as e:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(self._fault("postprocessing", e))))
        return responses
