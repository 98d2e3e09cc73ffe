"""An OpenAI-compatible HTTP frontend beside tritonserver: ``/v1/completions``, ``/v1/chat/completions``
and ``/v1/models``, every request sent through the Triton ensemble over gRPC streaming, so batching,
cancellation, metrics and the speculation switch stay in one place (FastAPI + uvicorn)."""
