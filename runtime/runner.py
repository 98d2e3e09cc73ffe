"""Runners execute one chunk of the target (or a draft) for a batch of sequences.

A runner has one method that matters, ``forward(input_ids, positions, lengths, logit_index,
state)`` -> ``(logits, new_state)``, with the I/O contract of ``builder.models`` modules. The
TorchRunner runs the eager definition (CPU or CUDA); the TensorRTRunner runs the serialized engine
with the TensorRT runtime on a GPU.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from runtime import state as state_lib


class Runner(Protocol):
    config: object
    dtype: torch.dtype
    device: torch.device

    def new_state(self, batch: int, capacity: int) -> dict[str, torch.Tensor]: ...

    def forward(self, input_ids, positions, lengths, logit_index, state: dict):
        ...


class TorchRunner:
    """Eager execution of a model module (the reference path)."""

    def __init__(self, module, device="cpu"):
        self.module = module
        self.config = module.cfg
        self.dtype = module.dtype
        self.device = torch.device(device)

    def new_state(self, batch, capacity):
        return state_lib.allocate(self.module.state_spec(batch, capacity), self.device)

    @torch.inference_mode()
    def forward(self, input_ids, positions, lengths, logit_index, state, all_states=False):
        return self.module.forward(input_ids, positions, lengths, logit_index, state, all_states)


class InterpreterRunner(TorchRunner):
    """Evaluates the engine's recorded TensorRT network on the CPU, layer by layer.

    Slow, but it executes exactly the network that ``nemospec build`` serializes, so a machine
    with no GPU can still check what an engine computes (``--backend interpreter``).
    """

    def __init__(self, module, contract):
        from builder.engine import record_target
        super().__init__(module, "cpu")
        self.network = record_target(module, contract)

    def forward(self, input_ids, positions, lengths, logit_index, state, all_states=False):
        from builder.interpreter import run_network
        if all_states:
            raise ValueError("the recorded target network has no per-position state outputs")
        feeds = {"input_ids": input_ids, "positions": positions, "lengths": lengths, "logit_index": logit_index}
        feeds.update({"past." + k: v for k, v in state.items()})
        out = run_network(self.network.network, feeds)
        return out["logits"], {k: out["present." + k] for k in state}


_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}


class TensorRTRunner:
    """Runs ``target.engine`` with the TensorRT runtime (needs a CUDA GPU).

    One execution context per optimization profile; a chunk goes to the smallest profile whose
    token range holds it (decode/verify chunks avoid the prefill profile's large workspace).
    """

    def __init__(self, engine_dir, component="target"):
        from builder.backends.trt_import import trt
        if not torch.cuda.is_available():
            raise RuntimeError("TensorRTRunner needs a CUDA GPU; use --backend torch on this machine")
        engine_dir = Path(engine_dir)
        meta = json.loads((engine_dir / "config.json").read_text())
        self.contract = meta["engines"][component]
        from builder.config import NemotronHConfig
        self.config = NemotronHConfig.from_dict(meta["model"])
        self.dtype = _TORCH_DTYPES[meta["build"]["dtype"]]
        self.device = torch.device("cuda")
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine((engine_dir / self.contract["file"]).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{engine_dir / self.contract['file']}: TensorRT could not deserialize the engine")
        self.stream = torch.cuda.Stream()
        self.contexts = []
        for index, profile in enumerate(self.contract["profiles"]):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(index, self.stream.cuda_stream)
            self.contexts.append((profile["max_tokens"], ctx))
        self.contexts.sort(key=lambda item: item[0])
        self._state_spec = self.contract["state"]

    def new_state(self, batch, capacity):
        spec = {}
        for name, entry in self._state_spec.items():
            shape = [batch if d == "batch" else capacity if d == "capacity" else d for d in entry["shape"]]
            spec[name] = (tuple(shape), _TORCH_DTYPES[entry["dtype"]])
        return state_lib.allocate(spec, self.device)

    def _context(self, tokens):
        for max_tokens, ctx in self.contexts:
            if tokens <= max_tokens:
                return ctx
        raise ValueError(f"chunk of {tokens} tokens exceeds the engine's max_input_len {self.contexts[-1][0]}")

    def forward(self, input_ids, positions, lengths, logit_index, state, all_states=False):
        if all_states:
            raise ValueError("this engine was not built with per-position state outputs")
        ctx = self._context(input_ids.shape[1])
        feeds = {"input_ids": input_ids, "positions": positions, "lengths": lengths, "logit_index": logit_index}
        feeds.update({"past." + k: v for k, v in state.items()})
        keep = []
        for name, tensor in feeds.items():
            tensor = tensor.to(self.device).contiguous()
            keep.append(tensor)
            ctx.set_input_shape(name, tuple(tensor.shape))
            ctx.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for name in ["logits"] + ["present." + k for k in state]:
            shape = tuple(ctx.get_tensor_shape(name))
            dtype = _TORCH_DTYPES[self.contract["outputs"][name]]
            outputs[name] = torch.empty(shape, dtype=dtype, device=self.device)
            ctx.set_tensor_address(name, outputs[name].data_ptr())
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        self.stream.synchronize()
        new_state = {k: outputs["present." + k] for k in state}
        return outputs["logits"], new_state
