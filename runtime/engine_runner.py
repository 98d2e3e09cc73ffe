"""Running an engine directory's networks: TensorRT on a GPU, or the CPU interpreter.

An executor runs one component (target, verify, draft) from named feeds to named outputs.
``EngineRunner`` puts the target (+ verify) executors behind the Runner interface; ``EngineDraft``
puts a feature draft's executor behind the ``step`` interface of ``runtime.drafts``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from builder.engine import TORCH_DTYPES
from builder.errors import UnavailableError
from runtime import state as state_lib
from runtime.drafts import EagerDraft
from runtime.runner import verify_tree_greedy

DTYPES = dict(TORCH_DTYPES, int32=torch.int32, int64=torch.int64, bool=torch.bool)


class InterpretedExecutor:
    """Evaluates the component's recorded network layer by layer on the CPU (slow; a check)."""

    def __init__(self, component):
        from builder.engine import record
        self.recorder, _ = record(component, native_plugins=True)

    def run(self, feeds: dict) -> dict:
        from builder.interpreter import run_network
        return run_network(self.recorder.network, feeds)


IO_ALIGNMENT = 256          # bytes: what TensorRT asks of an I/O tensor's address (torch's allocations are 512)
_DEVICE_WEIGHTS: dict = {}  # the device copies of --strip_plan weight inputs, shared by the engines


class TensorRTExecutor:
    """Runs a serialized engine with the TensorRT runtime; one execution context per profile."""

    def __init__(self, engine_dir, contract):
        from builder.backends.trt_import import HAS_PLUGIN_LAYERS, trt
        if not torch.cuda.is_available():
            raise UnavailableError("--backend tensorrt: the TensorRT backend needs a CUDA GPU; use --backend torch "
                                   "or compiled on this machine")
        if HAS_PLUGIN_LAYERS:  # engines may hold our plugin layers: register them before deserializing
            from plugins import fp4_markov_head, hidden_capture
            hidden_capture.register_tensorrt_plugin()
            fp4_markov_head.register_tensorrt_plugin()   # a DSpark markov.engine holds it
        path = Path(engine_dir) / contract["file"]
        self.contract = contract
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{path}: TensorRT could not deserialize the engine")
        from builder.refit import input_weights, refit_engine  # --strip_plan: weights from weights/ at load
        self.refitted = refit_engine(self.engine, engine_dir, path.stem, self._logger)
        self.weight_inputs = input_weights(engine_dir, path.stem, "cuda", _DEVICE_WEIGHTS)
        self.stream = torch.cuda.Stream()
        self.contexts = []
        for index, profile in enumerate(contract["profiles"]):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(index, self.stream.cuda_stream)
            self.contexts.append((profile["max_tokens"], ctx))
        self.contexts.sort(key=lambda item: item[0])

    def _context(self, tokens):
        for max_tokens, ctx in self.contexts:
            if tokens <= max_tokens:
                return ctx
        raise ValueError(f"chunk of {tokens} tokens exceeds the engine's largest profile ({self.contexts[-1][0]})")

    def run(self, feeds: dict) -> dict:
        ctx = self._context(max(t.shape[1] for n, t in feeds.items() if not n.startswith("past.") and t.dim() > 1))
        keep = []
        for name, tensor in feeds.items():
            tensor = tensor.to("cuda").contiguous()
            if tensor.data_ptr() % IO_ALIGNMENT:   # a view into a larger buffer: TensorRT wants aligned I/O
                tensor = tensor.clone()
            keep.append(tensor)
            if not ctx.set_input_shape(name, tuple(tensor.shape)):   # outside every profile: say which
                raise ValueError(f"{self.contract['file']}: input {name} of shape {list(tensor.shape)} is outside "
                                 "the engine's profiles (rebuild with larger --max_batch_size / --max_input_len)")
            ctx.set_tensor_address(name, tensor.data_ptr())
        for name, tensor in self.weight_inputs.items():  # static shapes (FP4 ones: 2 values a byte)
            ctx.set_input_shape(name, tuple(self.engine.get_tensor_shape(name)))
            ctx.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for name, dtype in self.contract["outputs"].items():
            outputs[name] = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=DTYPES[dtype], device="cuda")
            ctx.set_tensor_address(name, outputs[name].data_ptr())
        # the inputs were written on torch's current stream; this executor's stream must not run ahead
        self.stream.wait_stream(torch.cuda.current_stream())
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"TensorRT execution of {self.contract['file']} failed")
        self.stream.synchronize()
        return outputs


def _state_spec(contract, batch, capacity):
    return {name: (tuple(batch if d == "batch" else capacity if d == "capacity" else d for d in e["shape"]),
                   DTYPES[e["dtype"]]) for name, e in contract["state"].items()}


def _split(outputs):
    state = {n[len("present."):]: v for n, v in outputs.items() if n.startswith("present.")}
    features = {n[len("features."):]: v for n, v in outputs.items() if n.startswith("features.")}
    return outputs["logits"], state, features


class EngineRunner:
    """The Runner interface over a chunk engine (``main``), for verify passes ``verify`` and for
    token trees ``tree`` (an engine directory built with --tree_engines)."""

    def __init__(self, config, dtype, device, main, main_contract, verify=None, rollback=None, tree=None,
                 tree_rollback=None):
        """``rollback`` / ``tree_rollback``: the module's (eager torch on the runtime's tensors: a few
        small ops per Mamba layer once acceptance is known)."""
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.main, self.contract, self.verify, self.tree = main, main_contract, verify, tree
        self._rollback, self._tree_rollback = rollback, tree_rollback

    def new_state(self, batch, capacity):
        return state_lib.allocate(_state_spec(self.contract, batch, capacity), self.device)

    def forward(self, input_ids, positions, lengths, logit_index, state, verify=False, tree=None):
        executor = self.tree if tree is not None else self.verify if verify else self.main
        if executor is None:
            raise ValueError("this engine directory has no tree verify engine (build it with --tree_engines)"
                             if tree is not None else
                             "this engine directory has no verify engine (build it with a speculative mode)")
        feeds = {"input_ids": input_ids, "positions": positions, "lengths": lengths, "logit_index": logit_index}
        if tree is not None:
            feeds.update(parents=tree[0].to(torch.int32), ancestors=tree[1])
        feeds.update({"past." + k: v for k, v in state.items()})
        return _split(executor.run(feeds))

    @torch.inference_mode()
    def rollback(self, state, verified, accepted_rows):
        return self._rollback(state, verified, accepted_rows.to(self.device))

    @torch.inference_mode()
    def verify_tree_greedy(self, input_ids, positions, state, parents, base, depth):
        return verify_tree_greedy(self, input_ids, positions, state, parents, base, depth)

    @torch.inference_mode()
    def tree_rollback(self, state, verified, paths, lengths, base):
        dev = self.device
        return self._tree_rollback(state, verified, paths.to(dev), lengths.to(dev), base.to(dev))


class EngineDraft(EagerDraft):
    """A draft run from its engines (draft, and DSpark's markov); same interface as the eager one."""

    def __init__(self, module, target_vocab, executors: dict, contract, device):
        super().__init__(module, target_vocab, device)
        self.executors, self.contract = executors, contract

    def new_state(self, batch, capacity):
        return state_lib.allocate(_state_spec(self.contract, batch, capacity), self.device)

    def run(self, name, feeds):
        if name not in self.executors:
            raise ValueError(f"this engine directory has no {name} engine"
                             + (" (build it with --tree_engines)" if name == "draft_tree" else ""))
        return self.executors[name].run(feeds)

    def _call(self, name, feeds):
        """The one-call proposals (chain, tree, block) run the engines too."""
        return self.run(name, feeds)
