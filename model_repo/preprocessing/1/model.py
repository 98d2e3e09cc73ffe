"""nemospec preprocessing: text_input -> input ids (the engine directory's tokenizer.json, through the
``tokenizers`` library); stop_words / bad_words -> packed token-id lists. One prompt per request.
"""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


def _param(config, key, default=None):
    return config.get("parameters", {}).get(key, {}).get("string_value", default)


class BadInput(ValueError):
    pass


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        root = _param(config, "nemospec_root")
        if root and root not in sys.path:
            sys.path.insert(0, root)
        from tokenizers import Tokenizer

        from serving import limits
        from serving.protocol import fault, pack_word_ids, split_words
        self._pack, self._split, self._fault = pack_word_ids, split_words, fault
        self._limits, self.limits = limits, limits.decode_limits(_param(config, "limits", ""))
        engine_dir = Path(_param(config, "engine_dir"))
        meta = json.loads((engine_dir / "config.json").read_text())
        self.tokenizer = Tokenizer.from_file(str(engine_dir / meta["tokenizer"]))
        self.max_input_len = int(meta["build"]["max_input_len"])

    def _words(self, request, name, field):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            return self._pack([])
        try:
            words = self._split(tensor.as_numpy().reshape(-1).tolist())
        except UnicodeDecodeError:
            raise BadInput(f"{field}: not valid UTF-8") from None
        except ValueError as e:
            raise BadInput(f"{field}: {e}") from None
        self._limits.check_words(self.limits, field, words)
        ids = [self.tokenizer.encode(w, add_special_tokens=False).ids for w in words]
        return self._pack([i for i in ids if i])

    def _raw(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return () if tensor is None else tensor.as_numpy().reshape(-1).tolist()

    def _one(self, request):
        query = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy()
        if query.shape[0] != 1 or query.size != 1:
            raise BadInput(f"text_input: expected one prompt per request (batch size 1), got shape {list(query.shape)}")
        raw = query.reshape(-1)[0]
        self._limits.check_text(self.limits, raw, *(self._raw(request, n) for n in ("STOP_WORDS_DICT", "BAD_WORDS_DICT")))
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError:
            raise BadInput("text_input: not valid UTF-8") from None
        if not text:
            raise BadInput("text_input: empty; expected a prompt of at least one token")
        special = self._raw(request, "ADD_SPECIAL_TOKENS")
        ids = self.tokenizer.encode(text, add_special_tokens=bool(special[0]) if special else True).ids
        if not ids:
            raise BadInput("text_input: the prompt has no tokens")
        if len(ids) > self.max_input_len:
            raise BadInput(f"text_input: prompt of {len(ids)} tokens exceeds the engine's max_input_len {self.max_input_len}")
        out_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy().astype(np.int32)
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("INPUT_ID", np.asarray(ids, dtype=np.int32)[None]),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", out_len.reshape(1, 1)),
            pb_utils.Tensor("STOP_WORDS_IDS", self._words(request, "STOP_WORDS_DICT", "stop_words")[None]),
            pb_utils.Tensor("BAD_WORDS_IDS", self._words(request, "BAD_WORDS_DICT", "bad_words")[None]),
        ])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except (BadInput, self._limits.LimitError) as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
            except Exception as e:  # never take the server down for one request
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(self._fault("preprocessing", e))))
        return responses
